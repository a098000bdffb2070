# syntax=docker/dockerfile:1.7
# The KubeRL operator image: `kuberl operator` (kopf) and nothing of the runtime (no torch).
# Build from the repository root:  docker build -f images/operator.Dockerfile -t ghcr.io/kuberl/operator:0.1.0 .
# The Helm chart (charts/kuberl) runs it non-root with a read-only root file system.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a self-contained virtual environment with kuberl[operator] ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kuberl
COPY pyproject.toml README.md ./
COPY kuberl/ kuberl/
COPY operator/ operator/
# A regular (not editable) install: the final stage has no /src.
RUN /opt/kuberl/bin/pip install "/src[operator]" /src/operator

# ---- final: the venv on a slim base, numeric non-root user ----------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kuberl-operator" \
      org.opencontainers.image.source="https://github.com/kuberl/kuberl" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
# 65532 = the conventional "nonroot" uid; numeric so runAsNonRoot can verify it without /etc/passwd.
USER 65532:65532
# 8080: Prometheus metrics, 8081: liveness/readiness (kuberl operator --metrics-port/--health-port).
EXPOSE 8080 8081
ENTRYPOINT ["kuberl"]
CMD ["operator"]
