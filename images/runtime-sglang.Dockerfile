# syntax=docker/dockerfile:1.7
# KubeRL runtime image for NVIDIA GPUs with the SGLang engine: every in-pod role
# (`kuberl engine`, `kuberl rollout`, `torchrun ... kuberl trainer`) runs from this one image.
# Build from the repository root:  docker build -f images/runtime-sglang.Dockerfile -t ghcr.io/kuberl/runtime-sglang:0.1.0 .
# The operator picks it for spec.rollout.engine=sglang with accelerator nvidia.

# The CUDA major of the build stage must match the CUDA that the torch wheel was built with (PyPI's
# torch 2.14.1 for Linux x86_64 depends on CUDA 13: python -c "import torch; print(torch.version.cuda)"),
# and flash-attn compiles against both. Nodes need a driver for CUDA 13.
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

# ---- build: torch, SGLang, flash-attn and kuberl in one virtual environment -------------------
FROM ${CUDA_DEVEL_IMAGE} AS build
# Versions agree with pyproject.toml (tests/unit/test_images.py checks them).
# SGLang 0.5.23 is the first release that installs from PyPI (0.5.18-0.5.22 pin cuda-tile==1.6.0rc5,
# which PyPI lacks); it pins torch==2.14.1, so this image runs torch 2.14.1 while the other images
# and the test suite run 2.13.0 (kuberl[runtime] accepts both). `python scripts/check-image-deps.py
# runtime-sglang` resolves the set.
ARG TORCH_VERSION=2.14.1
ARG SGLANG_VERSION=0.5.23
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG KUBERL_EXTRAS=runtime,sglang,gpu,megatron
# flash-attn's CUDA build is memory hungry: each job takes several GB.
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=${MAX_JOBS}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git ninja-build \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
# torch first and pinned, then everything else with torch pinned on the same command line,
# so no resolver step can swap the torch build.
RUN pip install "torch==${TORCH_VERSION}" \
 && pip install "sglang==${SGLANG_VERSION}" "torch==${TORCH_VERSION}" \
 && pip install "packaging>=24" "wheel>=0.45" "setuptools>=75" "ninja>=1.11" "psutil>=5.9" \
 && pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kuberl/ kuberl/
COPY runtime/ runtime/
RUN pip install "/src[${KUBERL_EXTRAS}]" /src/runtime "torch==${TORCH_VERSION}" "sglang==${SGLANG_VERSION}" \
 && python -c "import torch, sglang, flash_attn, kuberl.cli; print('torch', torch.__version__, 'sglang', sglang.__version__)"

# ---- final: CUDA runtime libraries + the venv, numeric non-root user ------------------------
FROM ${CUDA_RUNTIME_IMAGE}
LABEL org.opencontainers.image.title="kuberl-runtime-sglang" \
      org.opencontainers.image.source="https://github.com/kuberl/kuberl" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --user-group --create-home --home-dir /home/kuberl kuberl
COPY --from=build /opt/kuberl /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/kuberl/.cache/huggingface \
    KUBERL_WORKDIR=/checkpoints
# uid 1000 = RUNTIME_UID of the operator's pod builders (runAsUser); Ubuntu's own uid-1000 user
# "ubuntu" is removed above so the name matches.
USER 1000:1000
WORKDIR /home/kuberl
# 8000: the engine's HTTP server (kuberl engine --port), 29500: torchrun rendezvous.
EXPOSE 8000 29500
ENTRYPOINT ["kuberl"]
CMD ["engine", "--config", "/etc/kuberl/experiment.yaml", "--port", "8000"]
