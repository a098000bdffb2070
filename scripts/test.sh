#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): installs what the tests need, then runs every tier
# in one pytest session: tests/unit (seconds), tests/integration (real nats-server, vLLM CPU; minutes),
# e2e_tests and the operator's integration tests (against $KUBECONFIG's cluster, or, when KUBECONFIG is unset, a real
# control plane built by scripts/install-control-plane.sh from the upstream Go modules and started on loopback), and
# tests/mutation (scripts/mutation-check.py's table: each planted RL bug must fail a test; ~4 min), on two
# pytest-xdist workers.
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh tests/unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# kube-apiserver, etcd, controller manager, scheduler, KWOK, kubectl, helm: built once (cached; found in < 1 s after),
# on a fresh machine while pip installs (the build is CPU-bound, pip mostly waits on downloads).
bash scripts/install-control-plane.sh >/dev/null &
control_plane=$!
bash scripts/setup.sh
wait "$control_plane" || { echo "test.sh: building the control plane failed (scripts/install-control-plane.sh)" >&2; exit 1; }
if [ "$#" -gt 0 ]; then exec "$PY" -m pytest "$@"; fi
# Two workers: the engine runs on one, one after another, everything else on the other meanwhile
# (tests/conftest.py): 47 min as one process on the 2-core dev VM. In collection order (no reorder by size), so the
# long trainer-only runs of tests/integration start early and the many short unit files fill the end; the mutation
# tier runs on the worker without the engine files, in the minutes it would otherwise wait for the engine worker.
exec "$PY" -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=40 tests e2e_tests
