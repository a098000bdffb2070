"""ControlPlane.wait_established on the real API server: a CRD waited for the moment it is created is Established once
the wait returns (where `kubectl wait --for=condition=Established` fails at once if it reads the CRD before the
apiextensions controller wrote its status), and a CRD that never appears is a timeout that names it."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def crd(plural: str) -> dict:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.waits.kuberl.io"},
            "spec": {"group": "waits.kuberl.io", "scope": "Namespaced",
                     "names": {"plural": plural, "singular": plural[:-1], "kind": plural[:-1].capitalize()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_a_crd_is_established_when_the_wait_returns_and_a_missing_one_times_out_by_name(kube):
    if not kube.local:
        pytest.skip("ControlPlane's own wait: only on the local control plane (KUBECONFIG unset)")
    cp = kube.control_plane
    plurals = ["alphas", "betas", "gammas"]  # distinct kinds: two CRDs of one kind in a group are never Established
    names = [f"{p}.waits.kuberl.io" for p in plurals]
    try:
        cp.kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [crd(p) for p in plurals]}))
        cp.wait_established(*names, timeout=60)
        for name in names:
            status = cp.kubectl("get", f"crd/{name}", "-o", "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
            assert status == "True", (name, status)  # read here, not through crd_established: the test checks that one too
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="CRD absents.waits.kuberl.io Established"):
            cp.wait_established("absents.waits.kuberl.io", timeout=2)
        assert time.monotonic() - started < 30
    finally:
        cp.kubectl("delete", "crd", *names, "--ignore-not-found", "--wait=false", check=False)
