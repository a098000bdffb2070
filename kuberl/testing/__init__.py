"""Test support shipped with KubeRL.

control_plane: a real Kubernetes control plane (kube-apiserver, etcd, controller manager, scheduler, KWOK nodes) built
from the upstream Go modules; what tests/integration and e2e_tests run against (`python -m kuberl.testing.control_plane`).
kmock_strict: the older emulated API server, kept for tests/unit/test_kueue.py and bench/bench_operator_scale.py;
tests/integration/test_emulator_parity.py holds it to the real API server's answers
(`python -m kuberl.testing.kmock_strict --kubeconfig /tmp/kubeconfig`).
"""
