#!/usr/bin/env bash
# The README's quickstart: installs what it needs (scripts/setup.sh), then runs examples/quickstart.yaml
# on this machine. Watch the reward rise; the curve lands in runs/quickstart/reward.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "==> kuberl run examples/quickstart.yaml${*:+ $*} (Ctrl-C stops every role)"
exec "${PYTHON:-python3}" -m kuberl.cli run examples/quickstart.yaml "$@"
