# Builds every KubeRL image (images/*.Dockerfile) with one command, from the repository root:
#
#   docker buildx bake --print                                   # what would be built
#   docker buildx bake --push                                    # all of them, to ghcr.io/kuberl
#   REGISTRY=europe-docker.pkg.dev/my-project/kuberl docker buildx bake --push runtime-vllm operator
#
# The tags are what the operator and the Helm chart pull by default: <REGISTRY>/operator:<VERSION>
# (values.yaml image.repository) and <REGISTRY>/runtime-<flavour>:<VERSION> (the operator's default
# runtime images; runtimeImages.repository in values.yaml). tests/unit/test_images.py checks that.
# .github/workflows/images.yml runs this on every v* tag.

# Where the images go; set runtimeImages.repository and image.repository to match.
variable "REGISTRY" {
  default = "ghcr.io/kuberl"
}

# The kuberl version (pyproject.toml, charts/kuberl/Chart.yaml appVersion): the operator renders
# runtime images with its own version, so the tags must carry it.
variable "VERSION" {
  default = "0.1.0"
}

group "default" {
  targets = ["operator", "runtime-vllm", "runtime-sglang", "runtime-npu", "runtime-cpu"]
}

# Shared by every target (bake merges the labels of inherited targets with the target's own).
target "_common" {
  context = "."
  labels = {
    "org.opencontainers.image.source"   = "https://github.com/kuberl/kuberl"
    "org.opencontainers.image.url"      = "https://github.com/kuberl/kuberl"
    "org.opencontainers.image.licenses" = "Apache-2.0"
    "org.opencontainers.image.vendor"   = "KubeRL authors"
    "org.opencontainers.image.version"  = "${VERSION}"
  }
}

target "operator" {
  inherits   = ["_common"]
  dockerfile = "images/operator.Dockerfile"
  tags       = ["${REGISTRY}/operator:${VERSION}"]
  platforms  = ["linux/amd64", "linux/arm64"]
  labels = {
    "org.opencontainers.image.title"       = "kuberl-operator"
    "org.opencontainers.image.description" = "KubeRL operator (kopf): reconciles RLExperiment resources"
  }
}

# The GPU images compile flash-attn against CUDA 13.0: x86_64 only, and hours on a small builder.
target "runtime-vllm" {
  inherits   = ["_common"]
  dockerfile = "images/runtime-vllm.Dockerfile"
  tags       = ["${REGISTRY}/runtime-vllm:${VERSION}"]
  platforms  = ["linux/amd64"]
  labels = {
    "org.opencontainers.image.title"       = "kuberl-runtime-vllm"
    "org.opencontainers.image.description" = "KubeRL runtime for NVIDIA GPUs: vLLM engine, rollout agent, FSDP trainer"
  }
}

target "runtime-sglang" {
  inherits   = ["_common"]
  dockerfile = "images/runtime-sglang.Dockerfile"
  tags       = ["${REGISTRY}/runtime-sglang:${VERSION}"]
  platforms  = ["linux/amd64"]
  labels = {
    "org.opencontainers.image.title"       = "kuberl-runtime-sglang"
    "org.opencontainers.image.description" = "KubeRL runtime for NVIDIA GPUs: SGLang engine, rollout agent, FSDP trainer"
  }
}

# Ascend nodes are often aarch64 (Kunpeng): build linux/arm64 too with
# --set runtime-npu.platforms=linux/arm64 and a CANN_IMAGE for that architecture.
target "runtime-npu" {
  inherits   = ["_common"]
  dockerfile = "images/runtime-npu.Dockerfile"
  tags       = ["${REGISTRY}/runtime-npu:${VERSION}"]
  platforms  = ["linux/amd64"]
  labels = {
    "org.opencontainers.image.title"       = "kuberl-runtime-npu"
    "org.opencontainers.image.description" = "KubeRL runtime for Huawei Ascend NPUs: torch-npu trainer and rollout agent"
  }
}

target "runtime-cpu" {
  inherits   = ["_common"]
  dockerfile = "images/runtime-cpu.Dockerfile"
  tags       = ["${REGISTRY}/runtime-cpu:${VERSION}"]
  platforms  = ["linux/amd64", "linux/arm64"]
  labels = {
    "org.opencontainers.image.title"       = "kuberl-runtime-cpu"
    "org.opencontainers.image.description" = "KubeRL runtime without accelerators: vLLM CPU engine, rollout agent, trainer"
  }
}
