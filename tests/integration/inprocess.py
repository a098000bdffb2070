"""The operator's own reconcile code (lifecycle.apply_children, the kopf handlers) called in the test process against
the real control plane (the root conftest.py's `kuberl_installed`: CRD installed by helm), so a test can change what
the operator is (an upgrade's new builders) or count what it asks, and the API server answers as a cluster does:
defaulting, immutable fields, server-side apply, the StatefulSet and Job controllers, KWOK's pods.

Experiments made here carry `spec.managedBy: MANAGED_BY`: the chart's operator of the session leaves them alone
(labels.managed_elsewhere), and `own_them` makes the in-process handlers take them as their own. Each module gets a
namespace of its own with a StorageClass and volumes of its own, so its PVCs bind without using the volumes the other
tests of the session share.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator.kube import KubeClient
from kuberl.operator.labels import MANAGED_BY_OPERATOR
from tests.unit.operator_run import run

MANAGED_BY = "kuberl.io/test-in-process"
STORAGE_CLASS = "kuberl-in-process"
RLX = "/apis/kuberl.io/v1alpha1/namespaces/{ns}/rlexperiments"


def prepare_namespace(kube: Any, namespace: str, volumes: int = 24) -> None:
    """The namespace, and `volumes` PersistentVolumes per access mode of STORAGE_CLASS (no provisioner, Immediate
    binding) named after it: an experiment's checkpoint and bus claims bind at once, from volumes of its own."""
    sc = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": STORAGE_CLASS},
          "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}
    pvs = [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-{mode.lower()}-{i}"},
            "spec": {"capacity": {"storage": "1Ti"}, "accessModes": [mode], "storageClassName": STORAGE_CLASS,
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/kuberl-fake-volumes/{namespace}-{i}"}}}
           for mode in ("ReadWriteOnce", "ReadWriteMany") for i in range(volumes)]
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    kube.run("kubectl", "apply", "--server-side", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [ns, sc, *pvs]}))


def drop_namespace(kube: Any, namespace: str) -> None:
    """Delete the namespace without waiting (its experiments' kopf finalizers go with the session's operator)."""
    kube.run("kubectl", "delete", "namespace", namespace, "--wait=false", check=False)


def namespace_fixture(namespace: str) -> Any:
    """A module-scoped fixture: the prepared namespace on the session's cluster, deleted after the module."""
    @pytest.fixture(scope="module")
    def cluster(kuberl_installed: Any) -> Iterator[Any]:
        prepare_namespace(kuberl_installed, namespace)
        yield kuberl_installed
        drop_namespace(kuberl_installed, namespace)
    return cluster


def own_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process handlers manage MANAGED_BY's experiments (and still leave any other foreign one alone)."""
    real = handlers.managed_elsewhere
    monkeypatch.setattr(handlers, "managed_elsewhere", lambda body: None if real(body) == MANAGED_BY else real(body))


def client_for(kube: Any) -> KubeClient:
    """The operator's KubeClient as `kuberl operator` builds it (kube._load_credentials), from the cluster's admin
    kubeconfig (the `kubernetes` package reads $KUBECONFIG once, at import: the file is named here)."""
    from unittest import mock

    from kubernetes import config

    from kuberl.operator import kube as kube_module

    real = config.load_kube_config
    with mock.patch.object(config, "load_kube_config", lambda **kw: real(config_file=kube.kubeconfig, **kw)):
        host, ctx, token = kube_module._load_credentials()
    return KubeClient(host, ssl_context=ctx, refresh=token)


def close_client() -> None:
    """Close the operator's aiohttp session (it belongs to the event loop of the last `run`)."""
    asyncio.run(h.CONFIG.kube.close())


def experiment(name: str, namespace: str, spec: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, Any]:
    """An RLExperiment manifest for the in-process operator: managedBy MANAGED_BY, claims on STORAGE_CLASS."""
    spec = {**spec, "managedBy": MANAGED_BY}
    spec["checkpoint"] = {"storageClassName": STORAGE_CLASS, **(spec.get("checkpoint") or {})}
    bus = spec.get("bus") or {}
    if "external" not in bus:
        spec["bus"] = {**bus, "embedded": {"storageClassName": STORAGE_CLASS, **(bus.get("embedded") or {})}}
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "spec": spec}


def create(manifest: dict[str, Any]) -> dict[str, Any]:
    """POST the experiment with the operator's client (the test acts as the user here)."""
    return run(h.kube().request("POST", RLX.format(ns=manifest["metadata"]["namespace"]), body=manifest))


def wait_for(what: str, fn: Any, timeout: float = 60) -> Any:
    """Poll `fn` until it returns something true (the cluster's controllers act on their own time)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


assert MANAGED_BY != MANAGED_BY_OPERATOR
