"""Test support shipped with KubeRL.

control_plane: a real Kubernetes control plane (kube-apiserver, etcd, controller manager, scheduler, KWOK nodes) built
from the upstream Go modules; what tests/integration, e2e_tests and bench/bench_operator_scale.py run against
(`python -m kuberl.testing.control_plane`). kueue: Kueue's real manager on it. admission_fuzz and admission_parity: the
generated manifests that the real API server and `kuberl validate` must judge alike.
"""
