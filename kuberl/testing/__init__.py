"""Test support shipped with KubeRL: the strict Kubernetes API emulator (kmock_strict).

Used by tests/integration, e2e_tests (when KUBECONFIG is unset) and anyone who wants to try the
operator without a cluster: `python -m kuberl.testing.kmock_strict --kubeconfig /tmp/kubeconfig`.
"""
