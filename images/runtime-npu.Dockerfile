# syntax=docker/dockerfile:1.7
# KubeRL runtime image for Huawei Ascend NPUs: torch + torch-npu on the CANN base image, for the
# trainer (`torchrun ... kuberl trainer`) and the rollout agent on Ascend nodes (huawei.com/Ascend910).
# Build from the repository root:  docker build -f images/runtime-npu.Dockerfile -t ghcr.io/kuberl/runtime-npu:0.1.0 .
#
# No inference engine is bundled: vllm-ascend is released per vLLM minor (its newest, 0.23.x,
# pairs with vLLM 0.23 and an older torch), and none matches vLLM 0.32 / torch 2.13 that every
# other KubeRL image pins. Until one does, run the rollout on GPU (or CPU) nodes, or build an
# engine image from the vllm-ascend release that matches your CANN (docs/guides: "Ascend").

# CANN images from the Ascend project: <cann>-<chip>-<os>-<python>. Pick the CANN release that the
# torch-npu version below is built for (Ascend/pytorch release notes) and the chip of your nodes.
ARG CANN_IMAGE=quay.io/ascend/cann:8.3.rc1-910b-ubuntu22.04-py3.11

# ---- build: torch (CPU wheel; torch-npu adds the device) + torch-npu + kuberl[runtime,npu] ---
FROM ${CANN_IMAGE} AS build
# Versions agree with pyproject.toml (tests/unit/test_images.py checks them).
ARG TORCH_VERSION=2.13.0
ARG TORCH_NPU_VERSION=2.13.0
ARG KUBERL_EXTRAS=runtime,npu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PIP_EXTRA_INDEX_URL=https://pypi.org/simple
RUN python3 -m venv /opt/kuberl
ENV PATH=/opt/kuberl/bin:$PATH
# torch-npu needs these at import time (its own requirements do not list them all).
RUN pip install "torch==${TORCH_VERSION}" \
 && pip install "torch-npu==${TORCH_NPU_VERSION}" "torch==${TORCH_VERSION}" "pyyaml>=6" "decorator>=5" "attrs>=23" "psutil>=5.9" "numpy>=1.26"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kuberl/ kuberl/
COPY runtime/ runtime/
RUN pip install "/src[${KUBERL_EXTRAS}]" /src/runtime "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}"

# ---- final: CANN toolkit + the venv, numeric non-root user ----------------------------------
FROM ${CANN_IMAGE}
LABEL org.opencontainers.image.title="kuberl-runtime-npu" \
      org.opencontainers.image.source="https://github.com/kuberl/kuberl" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kuberl /opt/kuberl
# What /usr/local/Ascend/ascend-toolkit/set_env.sh would export, as ENV, so that the plain
# `kuberl` entrypoint (no shell) finds CANN; the driver comes from the node (Ascend device plugin).
ENV ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest \
    ASCEND_HOME_PATH=/usr/local/Ascend/ascend-toolkit/latest \
    ASCEND_OPP_PATH=/usr/local/Ascend/ascend-toolkit/latest/opp \
    ASCEND_AICPU_PATH=/usr/local/Ascend/ascend-toolkit/latest \
    LD_LIBRARY_PATH=/usr/local/Ascend/driver/lib64/driver:/usr/local/Ascend/driver/lib64/common:/usr/local/Ascend/ascend-toolkit/latest/lib64:/usr/local/Ascend/ascend-toolkit/latest/lib64/plugin/opskernel:/usr/local/Ascend/ascend-toolkit/latest/lib64/plugin/nnengine \
    PYTHONPATH=/usr/local/Ascend/ascend-toolkit/latest/python/site-packages:/usr/local/Ascend/ascend-toolkit/latest/opp/built-in/op_impl/ai_core/tbe \
    PATH=/opt/kuberl/bin:/usr/local/Ascend/ascend-toolkit/latest/bin:/usr/local/Ascend/ascend-toolkit/latest/compiler/ccec_compiler/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/kuberl/.cache/huggingface \
    KUBERL_WORKDIR=/checkpoints
# The Ascend driver files on the node belong to HwHiAiUser, uid/gid 1000 as Ascend's install guide
# sets them up; the runtime runs as that uid (the operator keeps the image's user on NPU pods), so it
# may open /dev/davinci*. CANN images may already define the user.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 HwHiAiUser) \
 && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --no-create-home HwHiAiUser) \
 && mkdir -p /home/kuberl && chown 1000:1000 /home/kuberl
USER 1000:1000
WORKDIR /home/kuberl
# 29500: torchrun rendezvous.
EXPOSE 29500
ENTRYPOINT ["kuberl"]
CMD ["trainer", "--config", "/etc/kuberl/experiment.yaml"]
