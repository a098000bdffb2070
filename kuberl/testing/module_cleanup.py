"""Deleting what each module of the control-plane test group left on the local control plane (the root conftest.py's
hooks call it: `module_starts` before each test of the group, `module_ends` after a module's last test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuberl.testing.control_plane import STOPPED_EARLY


class ModuleExperiments:
    """The RLExperiments a test module left on the local control plane, deleted after its last test. Tests leave their
    experiments running (each test its own); the operator (monitor every 1 s here) then ticked every one of them until
    the session ended: ~100 by the group's end, 17% of a core for the operator alone, more for the API server and etcd."""

    def __init__(self) -> None:
        self.kube: Any = None  # conftest.py's Kube, set by `kube` on the local control plane
        self.module: Path | None = None
        self.before: set[str] = set()

    def _experiments(self) -> dict[str, tuple[str, str]]:
        cp = self.kube.control_plane
        r = cp.session().get(f"{cp.server}/apis/kuberl.io/v1alpha1/rlexperiments", timeout=30)
        if r.status_code != 200:  # no CRD yet (the chart not installed) or the server stopping
            return {}
        return {o["metadata"]["uid"]: (o["metadata"]["namespace"], o["metadata"]["name"]) for o in r.json().get("items", [])}

    def module_starts(self, item: Any) -> None:
        if item.path != self.module:
            self.module = item.path
            self.before = set(self._experiments()) if self.kube and not STOPPED_EARLY else set()

    def module_ends(self) -> None:
        if not self.kube or STOPPED_EARLY:
            return
        cp = self.kube.control_plane
        http = cp.session()
        for uid, (ns, name) in self._experiments().items():
            if uid not in self.before:
                http.delete(f"{cp.server}/apis/kuberl.io/v1alpha1/namespaces/{ns}/rlexperiments/{name}",
                            json={"propagationPolicy": "Background", "preconditions": {"uid": uid}}, timeout=30)
        self.module = None
