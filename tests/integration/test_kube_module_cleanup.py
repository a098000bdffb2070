"""The root conftest.py's ModuleExperiments on the real control plane: after a module of the control-plane group, the
RLExperiments it created are deleted (the operator stops ticking them), and those that existed before it are kept."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from kuberl.testing.module_cleanup import ModuleExperiments

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RLX = "/apis/kuberl.io/v1alpha1/namespaces/default/rlexperiments"


def manifest(name: str) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit", "size": 10}, "suspend": True}}


def test_a_modules_experiments_are_deleted_after_it_and_older_ones_kept(kuberl_installed, experiment_name):
    kube = kuberl_installed
    if not kube.local:
        pytest.skip("deletes experiments: only on the local control plane (KUBECONFIG unset)")
    cp = kube.control_plane
    http = cp.session()
    older, newer = f"{experiment_name}-a", f"{experiment_name}-b"
    assert http.post(cp.server + RLX, json=manifest(older)).status_code == 201
    cleanup = ModuleExperiments()
    cleanup.kube = kube
    cleanup.module_starts(SimpleNamespace(path="some_test_module.py"))
    assert http.post(cp.server + RLX, json=manifest(newer)).status_code == 201
    cleanup.module_ends()
    deadline = time.monotonic() + 60
    while http.get(f"{cp.server}{RLX}/{newer}").status_code != 404:  # the operator's finalizer runs first
        assert time.monotonic() < deadline, "the module's experiment was not deleted"
        time.sleep(0.3)
    assert http.get(f"{cp.server}{RLX}/{older}").status_code == 200, "an experiment from before the module was deleted"
    http.delete(f"{cp.server}{RLX}/{older}")
