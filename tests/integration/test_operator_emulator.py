"""The strict kmock emulator keeps the API server's contract that kopf and kubectl rely on.

Each test talks HTTP (or kubectl) to one emulator served on a loopback port for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from kuberl.testing.kmock_strict import EmulatorServer, default_crds

pytestmark = pytest.mark.integration
RLX = "/apis/kuberl.io/v1alpha1/namespaces/default/rlexperiments"
CM = "/api/v1/namespaces/default/configmaps"
STS = "/apis/apps/v1/namespaces/default/statefulsets"


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorServer]:
    with EmulatorServer(default_crds()) as server:
        server.kubeconfig = server.write_kubeconfig(tmp_path_factory.mktemp("emu") / "kubeconfig")  # type: ignore[attr-defined]
        yield server


def call(emu: EmulatorServer, method: str, path: str, body: Any = None, ctype: str = "application/json",
         params: dict[str, str] | None = None) -> requests.Response:
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    return requests.request(method, emu.url + path, data=data, headers={"Content-Type": ctype}, params=params, timeout=10)


def experiment(name: str, replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": replicas, "accelerator": {"type": "cpu", "count": 0}}}}


def configmap(name: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **extra}, "data": {"a": "1"}}


def test_core_discovery_says_group_version_v1_and_serves_namespaces_for_kopf(emu: EmulatorServer) -> None:
    doc = call(emu, "GET", "/api/v1").json()
    assert doc["groupVersion"] == "v1"
    names = {r["name"] for r in doc["resources"]}
    assert {"namespaces", "events", "pods", "configmaps"} <= names
    rlx = call(emu, "GET", "/apis/kuberl.io/v1alpha1").json()
    assert {"rlexperiments", "rlexperiments/status", "rlexperiments/scale"} <= {r["name"] for r in rlx["resources"]}


def test_resource_version_and_generation_follow_the_api_conventions(emu: EmulatorServer) -> None:
    created = call(emu, "POST", RLX, experiment("rv-gen")).json()
    rv0, gen0 = int(created["metadata"]["resourceVersion"]), created["metadata"]["generation"]
    same = call(emu, "PATCH", f"{RLX}/rv-gen", {"spec": {"suspend": False}}, "application/merge-patch+json").json()
    assert same["metadata"]["resourceVersion"] == str(rv0), "a no-op patch must not bump resourceVersion"
    status = call(emu, "PATCH", f"{RLX}/rv-gen/status", {"status": {"phase": "Running"}}, "application/merge-patch+json").json()
    assert int(status["metadata"]["resourceVersion"]) > rv0 and status["metadata"]["generation"] == gen0
    spec = call(emu, "PATCH", f"{RLX}/rv-gen", {"spec": {"suspend": True}}, "application/merge-patch+json").json()
    assert spec["metadata"]["generation"] == gen0 + 1


def test_the_status_subresource_isolates_status_from_spec(emu: EmulatorServer) -> None:
    call(emu, "POST", RLX, experiment("iso"))
    main = call(emu, "PATCH", f"{RLX}/iso", {"status": {"phase": "Failed"}}, "application/merge-patch+json").json()
    assert "phase" not in (main.get("status") or {})
    sub = call(emu, "PATCH", f"{RLX}/iso/status", {"spec": {"suspend": True}, "status": {"phase": "Running"}},
               "application/merge-patch+json").json()
    assert sub["status"]["phase"] == "Running" and not sub["spec"].get("suspend")


def test_a_failed_json_patch_test_is_422(emu: EmulatorServer) -> None:
    call(emu, "POST", CM, configmap("jp"))
    r = call(emu, "PATCH", f"{CM}/jp", [{"op": "test", "path": "/data/a", "value": "2"}, {"op": "replace", "path": "/data/a", "value": "3"}],
             "application/json-patch+json")
    assert r.status_code == 422 and r.json()["reason"] == "Invalid"
    assert call(emu, "GET", f"{CM}/jp").json()["data"]["a"] == "1"


def test_a_watch_from_a_resource_version_replays_only_later_events(emu: EmulatorServer) -> None:
    rv = call(emu, "POST", CM, configmap("w1")).json()["metadata"]["resourceVersion"]
    call(emu, "PATCH", f"{CM}/w1", {"data": {"a": "2"}}, "application/merge-patch+json")
    call(emu, "POST", CM, configmap("w2"))
    r = requests.get(emu.url + CM, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"}, timeout=10)
    events = [json.loads(line) for line in r.text.splitlines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "w1"), ("ADDED", "w2")]


def test_a_watch_subscribed_before_a_change_sees_it_live(emu: EmulatorServer) -> None:
    rv = call(emu, "GET", CM).json()["metadata"]["resourceVersion"]
    threading.Timer(0.3, lambda: call(emu, "POST", CM, configmap("live"))).start()
    r = requests.get(emu.url + CM, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "2"}, timeout=10)
    assert ("ADDED", "live") in [(json.loads(x)["type"], json.loads(x)["object"]["metadata"]["name"]) for x in r.text.splitlines()]


def test_crd_admission_rejects_schema_and_cel_violations_naming_the_field(emu: EmulatorServer) -> None:
    bad = experiment("bad-schema")
    bad["spec"]["rollout"]["replicas"] = -1
    r = call(emu, "POST", RLX, bad)
    assert r.status_code == 422 and "spec.rollout.replicas" in r.text.replace("rollout.replicas", "spec.rollout.replicas", 1)
    cel = experiment("bad-cel")
    cel["spec"]["model"]["id"] = "Qwen/Qwen2.5-0.5B"  # two model sources
    r = call(emu, "POST", RLX, cel)
    assert r.status_code == 422 and "set exactly one of model.id, model.path or model.builtin" in r.text


def test_unknown_fields_are_rejected_when_strict_and_pruned_with_a_warning_otherwise(emu: EmulatorServer) -> None:
    obj = experiment("unknown")
    obj["spec"]["bogus"] = 1
    strict = call(emu, "POST", RLX, obj, params={"fieldValidation": "Strict"})
    assert strict.status_code == 422 and "bogus" in strict.text
    lax = call(emu, "POST", RLX, obj)
    assert lax.status_code == 201 and "bogus" not in lax.json()["spec"] and "bogus" in lax.headers.get("Warning", "")


def test_server_side_apply_removes_fields_the_manager_stopped_applying(emu: EmulatorServer) -> None:
    path, params = f"{CM}/ssa", {"fieldManager": "kuberl-operator", "force": "true"}
    first = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1", "b": "2"}}
    assert call(emu, "PATCH", path, first, "application/apply-patch+yaml", params).status_code == 201
    call(emu, "PATCH", path, {"data": {"other": "x"}}, "application/merge-patch+json")
    second = {**first, "data": {"a": "1"}}
    data = call(emu, "PATCH", path, second, "application/apply-patch+yaml", params).json()["data"]
    assert data == {"a": "1", "other": "x"}
    assert call(emu, "PATCH", path, second, "application/apply-patch+yaml").status_code == 400  # fieldManager is required


def test_immutable_statefulset_fields_cannot_change(emu: EmulatorServer) -> None:
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "imm"},
           "spec": {"serviceName": "imm", "replicas": 1, "selector": {"matchLabels": {"app": "imm"}},
                    "template": {"metadata": {"labels": {"app": "imm"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    assert call(emu, "POST", STS, sts).status_code == 201
    assert call(emu, "PATCH", f"{STS}/imm", {"spec": {"replicas": 2}}, "application/merge-patch+json").status_code == 200
    r = call(emu, "PATCH", f"{STS}/imm", {"spec": {"serviceName": "other"}}, "application/merge-patch+json")
    assert r.status_code == 422 and "serviceName" in r.text


def test_deleting_an_owner_collects_its_dependents_and_finalizers_hold_deletion(emu: EmulatorServer) -> None:
    owner = call(emu, "POST", CM, configmap("owner")).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"], "controller": True}
    call(emu, "POST", CM, configmap("dep", ownerReferences=[ref]))
    call(emu, "POST", CM, configmap("held", ownerReferences=[ref], finalizers=["test/hold"]))
    call(emu, "DELETE", f"{CM}/owner")
    deadline = time.monotonic() + 5
    while call(emu, "GET", f"{CM}/dep").status_code != 404 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert call(emu, "GET", f"{CM}/dep").status_code == 404
    held = call(emu, "GET", f"{CM}/held").json()
    assert held["metadata"].get("deletionTimestamp"), "a finalizer keeps the object, marked for deletion"
    call(emu, "PATCH", f"{CM}/held", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    assert call(emu, "GET", f"{CM}/held").status_code == 404


def test_the_scale_subresource_maps_to_spec_rollout_replicas(emu: EmulatorServer) -> None:
    call(emu, "POST", RLX, experiment("scaled"))
    scale = call(emu, "PATCH", f"{RLX}/scaled/scale", {"spec": {"replicas": 4}}, "application/merge-patch+json").json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4
    assert call(emu, "GET", f"{RLX}/scaled").json()["spec"]["rollout"]["replicas"] == 4


def test_kubectl_gets_printer_columns_and_scales_and_patches(emu: EmulatorServer) -> None:
    env = {**os.environ, "KUBECONFIG": str(emu.kubeconfig)}  # type: ignore[attr-defined]

    def kubectl(*args: str, stdin: str | None = None) -> str:
        r = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, input=stdin, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout

    manifest = json.dumps(experiment("kc"))
    assert "created" in kubectl("apply", "-f", "-", stdin=manifest)
    assert "unchanged" in kubectl("apply", "-f", "-", stdin=manifest)
    kubectl("scale", "rlx/kc", "--replicas", "2")
    kubectl("patch", "rlx", "kc", "--subresource=status", "--type=merge", "-p",
            json.dumps({"status": {"phase": "Running", "progress": {"steps": "3/10", "policyVersion": 3, "rewardText": "0.50",
                                                                  "samplesPerSecond": 41.5, "stalenessMean": 0.8},
                                   "conditions": [{"type": "Ready", "status": "False", "reason": "WaitingForRollout", "message": "m",
                                                   "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                                   "rollout": {"readyText": "2/2"}, "trainer": {"readyText": "1/1"}, "restarts": 0}}))
    lines = kubectl("get", "rlx", "kc").splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "REASON", "STEP", "VERSION", "REWARD", "ROLLOUT", "AGE"]
    assert lines[1].split()[:7] == ["kc", "Running", "WaitingForRollout", "3/10", "3", "0.50", "2/2"]
    wide = kubectl("get", "rlx", "kc", "-o", "wide").splitlines()
    assert wide[0].split()[-4:] == ["SAMPLES/S", "STALENESS", "TRAINER", "RESTARTS"]
    assert wide[1].split()[-4:] == ["41.5", "0.8", "1/1", "0"]
    kubectl("delete", "rlx", "kc", "--wait=true", "--timeout=20s")


def test_the_operator_client_reloads_expired_credentials_once_on_401(emu: EmulatorServer) -> None:
    """kmock reactions still win over the emulation: a 401 for a stale token is injected."""
    import asyncio

    import kmock

    from kuberl.operator.kube import KubeClient

    reloads = []

    def reload() -> tuple[str, None, object]:
        reloads.append(1)
        return emu.url, None, lambda: "Bearer fresh"

    async def go() -> dict:
        client = KubeClient(emu.url, refresh=lambda: "Bearer stale", reload=reload)
        try:
            return await client.get("Namespace", None, "default")
        finally:
            await client.close()

    emu.call(lambda e: e[kmock.headers({"Authorization": "Bearer stale"})] << 401)
    assert asyncio.run(go())["metadata"]["name"] == "default"
    assert reloads == [1]
