"""Two operator replicas elect a leader by a Lease (kuberl operator --leader-election, as the chart runs them), on the
real control plane under the chart's RBAC: the standby takes over when the leader is killed (SIGKILL: its Lease
expires, 15 s, measured on the standby's clock), and at once when the leader stops cleanly (it releases the Lease).
kopf's peering, which the Lease replaces for several replicas, let a standby take over only once the dead peer's
record was a minute old (docs/operations.md has both figures)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kuberl.operator.leader import LEASE_NAME, LEASE_SECONDS, RETRY_PERIOD
from kuberl.testing.operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RLX = "/apis/kuberl.io/v1alpha1/namespaces/default/rlexperiments"


def lease(cp: Any) -> dict[str, Any]:
    r = cp.session().get(f"{cp.server}/apis/coordination.k8s.io/v1/namespaces/kuberl-system/leases/{LEASE_NAME}")
    assert r.status_code == 200, r.text
    return r.json()["spec"]


def reconciled_within(cp: Any, name: str, timeout: float) -> float:
    """Create an experiment; seconds until an operator gives it a phase (someone leads)."""
    from tests.integration.test_operator import manifest

    http = cp.session()
    t0 = time.monotonic()
    r = http.post(f"{cp.server}{RLX}", json=manifest(name))
    assert r.status_code == 201, r.text
    while time.monotonic() - t0 < timeout:
        got = http.get(f"{cp.server}{RLX}/{name}").json()
        if (got.get("status") or {}).get("phase"):
            return time.monotonic() - t0
        time.sleep(0.25)
    raise AssertionError(f"no operator reconciled {name} within {timeout} s")


def test_a_standby_takes_over_from_a_killed_leader_within_the_lease_and_at_once_from_a_clean_stop(kuberl_installed, tmp_path) -> None:
    kube = kuberl_installed
    if not kube.local:
        pytest.skip("kills the session's operator process: runs on the local control plane (KUBECONFIG unset)")
    cp, first = kube.control_plane, kube.operator
    assert lease(cp)["holderIdentity"] == "kuberl-local-0"
    env = {"POD_NAME": "kuberl-local-1", "POD_NAMESPACE": "kuberl-system"}
    with OperatorProcess(kube.operator_kubeconfig, tmp_path / "standby.log", interval=1.0, checkpoint_timeout=5.0,
                         standalone=False, leader_election=True, extra_env=env) as standby:
        time.sleep(2 * RETRY_PERIOD)
        assert lease(cp)["holderIdentity"] == "kuberl-local-0", "a standby took a Lease its holder renews"
        first.proc.kill()  # a node lost, an OOM kill: no release
        first.proc.wait(10)
        killed = time.monotonic()
        took = reconciled_within(cp, "leader-after-kill", LEASE_SECONDS + 30)
        after_kill = time.monotonic() - killed
        assert lease(cp)["holderIdentity"] == "kuberl-local-1" and standby.alive
        assert LEASE_SECONDS - RETRY_PERIOD <= after_kill <= LEASE_SECONDS + 20, f"took over {after_kill:.1f} s after the kill ({took:.1f} s)"
        first.restart()  # back as a standby: the Lease is held
        time.sleep(RETRY_PERIOD)
        assert lease(cp)["holderIdentity"] == "kuberl-local-1"
    # The standby stopped cleanly (SIGTERM) and released the Lease: the first replica leads within a retry period or two.
    stopped = time.monotonic()
    reconciled_within(cp, "leader-after-stop", 30)
    handover = time.monotonic() - stopped
    assert lease(cp)["holderIdentity"] == "kuberl-local-0"
    assert handover < LEASE_SECONDS - RETRY_PERIOD, f"a released Lease took {handover:.1f} s to change hands"
    print(f"takeover after SIGKILL {after_kill:.1f} s; after a clean stop {handover:.1f} s")
