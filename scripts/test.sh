#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what the tests need, then runs every tier
# in one pytest session: tests/unit (seconds), tests/integration (real nats-server, vLLM CPU; minutes),
# e2e_tests (kubectl against $KUBECONFIG, or against the kmock emulator when KUBECONFIG is unset).
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh tests/unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then set -- tests e2e_tests; fi
exec "$PY" -m pytest "$@"
