"""Parity: the emulated API server (kuberl.testing.kmock_strict, still used by tests/unit/test_kueue.py) answers as the
real kube-apiserver does for the contract kopf, kubectl and the operator rely on. Each test runs twice, against the
emulator and against the session's real control plane (the root conftest.py's `kuberl_installed`), with the same
requests and the same assertions: no test may pass on the emulator and fail on the real server.

Experiments here carry spec.managedBy kuberl.io/test-in-process, so the session's operator leaves them alone.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tests.integration.inprocess import MANAGED_BY

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
NS = "api-parity"
RLX = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments"
CM = f"/api/v1/namespaces/{NS}/configmaps"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"


@dataclass
class Server:
    """One API server as the tests talk to it: plain HTTP (requests) and kubectl."""

    name: str
    url: str
    http: requests.Session
    kubeconfig: str
    kubectl_bin: str = "kubectl"

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json",
             params: dict[str, str] | None = None, timeout: float = 10) -> requests.Response:
        data = body if isinstance(body, str) or body is None else json.dumps(body)
        return self.http.request(method, self.url + path, data=data, headers={"Content-Type": ctype}, params=params, timeout=timeout)

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        r = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, "-n", NS, *args], capture_output=True, text=True,
                           input=stdin, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout


@pytest.fixture(scope="module", params=["emulator", "kube-apiserver"])
def server(request: pytest.FixtureRequest, kuberl_installed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The emulator (the CRD generated from kuberl.api), or the real API server (the CRD installed by helm)."""
    if request.param == "emulator":
        from kuberl.testing.emulator_server import EmulatorServer, default_crds

        with EmulatorServer(default_crds(), namespaces=("default", NS)) as emu:
            kubeconfig = emu.write_kubeconfig(tmp_path_factory.mktemp("emu") / "kubeconfig")
            yield Server("emulator", emu.url, requests.Session(), str(kubeconfig))
        return
    kube = kuberl_installed
    made = kube.run("kubectl", "create", "namespace", NS, check=False)
    assert made.returncode == 0 or "AlreadyExists" in made.stderr, made.stderr
    cp = kube.control_plane
    yield Server("kube-apiserver", cp.server, cp.session(), kube.kubeconfig, str(cp.bin / "kubectl"))
    kube.run("kubectl", "delete", "namespace", NS, "--wait=false", check=False)


def experiment(name: str, replicas: int = 1) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "managedBy": MANAGED_BY,
                     "rollout": {"replicas": replicas, "accelerator": {"type": "cpu", "count": 0}}}}


def configmap(name: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **extra}, "data": {"a": "1"}}


def wait_until(what: str, fn: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_core_discovery_says_group_version_v1_and_serves_namespaces_for_kopf(server: Server) -> None:
    doc = server.call("GET", "/api/v1").json()
    assert doc["groupVersion"] == "v1"
    assert {"namespaces", "events", "pods", "configmaps"} <= {r["name"] for r in doc["resources"]}
    rlx = server.call("GET", "/apis/kuberl.io/v1alpha1").json()
    assert {"rlexperiments", "rlexperiments/status", "rlexperiments/scale"} <= {r["name"] for r in rlx["resources"]}


def settled(server: Server, path: str) -> dict[str, Any]:
    """The object once nobody else writes it for a second: on the real server the session's operator, which leaves an
    experiment managed elsewhere alone, still adds kopf's finalizer and bookkeeping to it first (a suite run caught
    that write between this test's create and its no-op patch)."""
    last: dict[str, Any] | None = None
    for _ in range(60):
        now = server.call("GET", path).json()
        if last is not None and now["metadata"]["resourceVersion"] == last["metadata"]["resourceVersion"]:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError(f"{path} kept changing for 30 s")


def test_resource_version_and_generation_follow_the_api_conventions(server: Server) -> None:
    server.call("POST", RLX, experiment("rv-gen"))
    created = settled(server, f"{RLX}/rv-gen")
    rv0, gen0 = int(created["metadata"]["resourceVersion"]), created["metadata"]["generation"]
    same = server.call("PATCH", f"{RLX}/rv-gen", {"spec": {"rollout": {"replicas": 1}}}, "application/merge-patch+json").json()
    assert same["metadata"]["resourceVersion"] == str(rv0), "a no-op patch must not bump resourceVersion"
    status = server.call("PATCH", f"{RLX}/rv-gen/status", {"status": {"phase": "Running"}}, "application/merge-patch+json").json()
    assert int(status["metadata"]["resourceVersion"]) > rv0 and status["metadata"]["generation"] == gen0
    spec = server.call("PATCH", f"{RLX}/rv-gen", {"spec": {"suspend": True}}, "application/merge-patch+json").json()
    assert spec["metadata"]["generation"] == gen0 + 1


def test_the_status_subresource_isolates_status_from_spec(server: Server) -> None:
    server.call("POST", RLX, experiment("iso"))
    main = server.call("PATCH", f"{RLX}/iso", {"status": {"phase": "Failed"}}, "application/merge-patch+json").json()
    assert "phase" not in (main.get("status") or {})
    sub = server.call("PATCH", f"{RLX}/iso/status", {"spec": {"suspend": True}, "status": {"phase": "Running"}},
                      "application/merge-patch+json").json()
    assert sub["status"]["phase"] == "Running" and not sub["spec"].get("suspend")


def test_a_failed_json_patch_test_is_refused_and_changes_nothing(server: Server) -> None:
    server.call("POST", CM, configmap("jp"))
    r = server.call("PATCH", f"{CM}/jp", [{"op": "test", "path": "/data/a", "value": "2"}, {"op": "replace", "path": "/data/a", "value": "3"}],
                    "application/json-patch+json")
    assert r.status_code == 422 and r.json()["reason"] == "Invalid", (r.status_code, r.text)
    assert server.call("GET", f"{CM}/jp").json()["data"]["a"] == "1"


def test_a_watch_from_a_resource_version_replays_only_later_events(server: Server) -> None:
    rv = server.call("POST", CM, configmap("w1")).json()["metadata"]["resourceVersion"]
    server.call("PATCH", f"{CM}/w1", {"data": {"a": "2"}}, "application/merge-patch+json")
    server.call("POST", CM, configmap("w2"))
    r = server.call("GET", CM, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"})
    events = [json.loads(line) for line in r.text.splitlines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "w1"), ("ADDED", "w2")]


def test_a_watch_subscribed_before_a_change_sees_it_live(server: Server) -> None:
    rv = server.call("GET", CM).json()["metadata"]["resourceVersion"]
    threading.Timer(0.3, lambda: server.call("POST", CM, configmap("live"))).start()
    r = server.call("GET", CM, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "2"})
    assert ("ADDED", "live") in [(json.loads(x)["type"], json.loads(x)["object"]["metadata"]["name"]) for x in r.text.splitlines()]


def test_crd_admission_rejects_schema_and_cel_violations_naming_the_field(server: Server) -> None:
    bad = experiment("bad-schema")
    bad["spec"]["rollout"]["replicas"] = -1
    r = server.call("POST", RLX, bad)
    assert r.status_code == 422 and "spec.rollout.replicas" in r.text, r.text
    cel = experiment("bad-cel")
    cel["spec"]["model"]["id"] = "Qwen/Qwen2.5-0.5B"  # two model sources
    r = server.call("POST", RLX, cel)
    assert r.status_code == 422 and "set exactly one of model.id, model.path or model.builtin" in r.text, r.text


def test_unknown_fields_are_rejected_when_strict_and_pruned_with_a_warning_otherwise(server: Server) -> None:
    obj = experiment("unknown")
    obj["spec"]["bogus"] = 1
    strict = server.call("POST", RLX, obj, params={"fieldValidation": "Strict"})
    assert strict.status_code == 400 and 'strict decoding error: unknown field "spec.bogus"' in strict.json()["message"], strict.text
    # A server-side apply (the operator's writes: fieldValidation=Strict) fails building its typed patch: a 500.
    applied = server.call("PATCH", f"{RLX}/unknown", obj, "application/apply-patch+yaml",
                          {"fieldManager": "kuberl-operator", "force": "true", "fieldValidation": "Strict"})
    assert applied.status_code == 500 and ".spec.bogus: field not declared in schema" in applied.json()["message"], applied.text
    lax = server.call("POST", RLX, obj)
    assert lax.status_code == 201 and "bogus" not in lax.json()["spec"] and "bogus" in lax.headers.get("Warning", "")


def test_server_side_apply_removes_fields_the_manager_stopped_applying(server: Server) -> None:
    path, params = f"{CM}/ssa", {"fieldManager": "kuberl-operator", "force": "true"}
    first = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1", "b": "2"}}
    assert server.call("PATCH", path, first, "application/apply-patch+yaml", params).status_code == 201
    server.call("PATCH", path, {"data": {"other": "x"}}, "application/merge-patch+json")
    second = {**first, "data": {"a": "1"}}
    data = server.call("PATCH", path, second, "application/apply-patch+yaml", params).json()["data"]
    assert data == {"a": "1", "other": "x"}
    r = server.call("PATCH", path, second, "application/apply-patch+yaml")
    assert r.status_code == 422 and "fieldManager: Required value" in r.text, r.text


def test_immutable_statefulset_fields_cannot_change(server: Server) -> None:
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "imm"},
           "spec": {"serviceName": "imm", "replicas": 0, "selector": {"matchLabels": {"app": "imm"}},
                    "template": {"metadata": {"labels": {"app": "imm"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    assert server.call("POST", STS, sts).status_code == 201
    assert server.call("PATCH", f"{STS}/imm", {"spec": {"replicas": 1}}, "application/merge-patch+json").status_code == 200
    r = server.call("PATCH", f"{STS}/imm", {"spec": {"serviceName": "other"}}, "application/merge-patch+json")
    assert r.status_code == 422 and "Forbidden: updates to statefulset spec for fields other than 'replicas'" in r.text, r.text


def test_deleting_an_owner_collects_its_dependents_and_finalizers_hold_deletion(server: Server) -> None:
    owner = server.call("POST", CM, configmap("owner")).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"], "controller": True}
    server.call("POST", CM, configmap("dep", ownerReferences=[ref]))
    server.call("POST", CM, configmap("held", ownerReferences=[ref], finalizers=["kuberl.io/test-hold"]))
    server.call("DELETE", f"{CM}/owner")
    wait_until("the dependent collected", lambda: server.call("GET", f"{CM}/dep").status_code == 404)
    wait_until("the held dependent marked", lambda: server.call("GET", f"{CM}/held").json()["metadata"].get("deletionTimestamp"))
    server.call("PATCH", f"{CM}/held", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    wait_until("the held dependent gone once released", lambda: server.call("GET", f"{CM}/held").status_code == 404, 5)


def test_the_scale_subresource_maps_to_spec_rollout_replicas(server: Server) -> None:
    server.call("POST", RLX, experiment("scaled"))
    scale = server.call("PATCH", f"{RLX}/scaled/scale", {"spec": {"replicas": 4}}, "application/merge-patch+json").json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4
    assert server.call("GET", f"{RLX}/scaled").json()["spec"]["rollout"]["replicas"] == 4


def test_a_secret_keeps_string_data_in_data_only(server: Server) -> None:
    """stringData is write-only, merged into data (base64, winning over a data key of the same name), never returned:
    the operator writes its Secrets with stringData and reads them back from data."""
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s1"}, "type": "Opaque",
            "data": {"kept": b64("old"), "both": b64("from-data")}, "stringData": {"both": "from-stringData", "new": "multi\nline"}}
    assert server.call("POST", SECRETS, body).status_code == 201
    got = server.call("GET", f"{SECRETS}/s1").json()
    assert "stringData" not in got
    assert got["data"] == {"kept": b64("old"), "both": b64("from-stringData"), "new": b64("multi\nline")}
    r = server.call("PATCH", f"{SECRETS}/s1", {"stringData": {"kept": "patched"}}, "application/merge-patch+json")
    assert r.status_code == 200 and "stringData" not in r.json() and r.json()["data"]["kept"] == b64("patched")


def test_kubectl_gets_printer_columns_and_scales_and_patches(server: Server) -> None:
    manifest = json.dumps(experiment("kc"))
    assert "created" in server.kubectl("apply", "-f", "-", stdin=manifest)
    assert "unchanged" in server.kubectl("apply", "-f", "-", stdin=manifest)
    server.kubectl("scale", "rlx/kc", "--replicas", "2")
    server.kubectl("patch", "rlx", "kc", "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": {"phase": "Running", "progress": {"steps": "3/10", "policyVersion": 3, "rewardText": "0.50",
                                                                         "samplesPerSecond": 41.5, "stalenessMean": 0.8},
                                          "conditions": [{"type": "Ready", "status": "False", "reason": "WaitingForRollout", "message": "m",
                                                          "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                                          "rollout": {"readyText": "2/2"}, "trainer": {"readyText": "1/1"}, "restarts": 0}}))
    lines = server.kubectl("get", "rlx", "kc").splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "REASON", "STEP", "VERSION", "REWARD", "ROLLOUT", "AGE"]
    assert lines[1].split()[:7] == ["kc", "Running", "WaitingForRollout", "3/10", "3", "0.50", "2/2"]
    wide = server.kubectl("get", "rlx", "kc", "-o", "wide").splitlines()
    assert wide[0].split()[-4:] == ["SAMPLES/S", "STALENESS", "TRAINER", "RESTARTS"]
    assert wide[1].split()[-4:] == ["41.5", "0.8", "1/1", "0"]
    server.kubectl("delete", "rlx", "kc", "--wait=true", "--timeout=20s")


def test_the_operator_client_reloads_expired_credentials_once_on_401(kuberl_installed: Any) -> None:
    """A token the API server no longer accepts (an expired exec-plugin token) gets a real 401; the operator's client
    reloads its credentials once and retries. Real server only: the emulator authenticates nobody."""
    import asyncio
    import ssl

    from kuberl.operator.kube import KubeClient

    cp = kuberl_installed.control_plane
    ctx = ssl.create_default_context(cafile=str(cp.dir / "ca.crt"))
    reloads = []

    def reload() -> tuple[str, Any, Any]:
        reloads.append(1)
        return cp.server, ctx, lambda: f"Bearer {cp.admin_token}"

    async def go() -> dict:
        client = KubeClient(cp.server, ssl_context=ctx, refresh=lambda: "Bearer stale", reload=reload)
        try:
            return await client.get("Namespace", None, "default")
        finally:
            await client.close()

    assert asyncio.run(go())["metadata"]["name"] == "default"
    assert reloads == [1]
