"""The real operator against a real control plane: kube-apiserver, etcd, the controller manager (StatefulSet, Job,
garbage collector, PV binder...), the scheduler and KWOK's fake nodes (the root conftest.py's `kuberl_installed`:
the chart installed with helm, the operator running with the chart's ServiceAccount).

Each test uses its own experiment. Pods run no containers: KWOK makes them Running and Ready, and a test plays
their containers' exits through annotations (ControlPlane.exit). Bus progress comes from a REAL nats-server (the
session `nats_server` fixture) where a test needs it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kuberl.testing.control_plane import NODE_POOLS, ControlPlane
from kuberl.testing.operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
NS = "default"
RLX = "/apis/kuberl.io/v1alpha1/namespaces/default/rlexperiments"


class Api:
    """Plain HTTP to the API server as its admin (a bearer token, TLS checked against the cluster's CA)."""

    def __init__(self, cp: ControlPlane, operator: OperatorProcess):
        self.cp, self.url, self.operator, self.http = cp, cp.server, operator, cp.session()

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json", ok: tuple[int, ...] = (200, 201)) -> Any:
        r = self.http.request(method, self.url + path, data=None if body is None else json.dumps(body), headers={"Content-Type": ctype})
        assert r.status_code in ok, f"{method} {path}: {r.status_code} {r.text[:500]}"
        return r.json() if r.content else None

    def get(self, path: str) -> Any:
        r = self.http.get(self.url + path)
        return r.json() if r.status_code == 200 else None

    def merge(self, path: str, patch: dict[str, Any]) -> Any:
        return self.call("PATCH", path, patch, "application/merge-patch+json")

    def wait(self, what: str, fn: Callable[[], Any], timeout: float = 60) -> Any:
        return self.operator.wait(what, fn, timeout)

    def experiment(self, name: str) -> Any:
        return self.get(f"{RLX}/{name}")

    def phase(self, name: str) -> str | None:
        return ((self.experiment(name) or {}).get("status") or {}).get("phase")

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.get("/api/v1/namespaces/default/events")["items"]
        return [e for e in items if e["involvedObject"].get("name") == name]

    def event_reasons(self, name: str) -> set[str]:
        return {e["reason"] for e in self.events(name)}

    def sts(self, name: str) -> Any:
        return self.get(f"/apis/apps/v1/namespaces/default/statefulsets/{name}")

    def job(self, name: str) -> Any:
        return self.get(f"/apis/batch/v1/namespaces/default/jobs/{name}")

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={selector}")["items"]

    def trainer_pods(self, exp: str) -> list[str]:
        """The running pods of the experiment's current trainer Job (not those of a Job it replaced)."""
        job = self.wait("trainer Job", lambda: self.job(f"{exp}-trainer"))
        n = job["spec"].get("parallelism", 1)

        def running() -> list[str] | None:
            pods = [p for p in self.pods(f"batch.kubernetes.io/controller-uid={job['metadata']['uid']}")
                    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
            return [p["metadata"]["name"] for p in pods] if len(pods) == n else None
        return self.wait(f"{n} running trainer pods", running)

    def finish_job(self, exp: str, kind: str = "Complete", code: int | None = None, message: str = "") -> None:
        """The trainer's containers exit (0 for Complete, 1 for Failed, or `code`); the Job controller does the rest."""
        self.cp.exit(NS, self.trainer_pods(exp), (0 if kind == "Complete" else 1) if code is None else code, message)


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    base = {"model": {"builtin": "tiny-qwen2", "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 100},
            "workflow": {"reward": "repeat-digit"},
            "algorithm": {"samplesPerPrompt": 2, "batchSize": 2, "maxNewTokens": 4},
            "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}},
            "checkpoint": {"size": "1Gi"}, "training": {"totalSteps": 10}}
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS}, "spec": base}


def kv(url: str, exp: str, key: str, value: dict[str, Any] | None = None, *, run: str) -> dict[str, Any] | None:
    """Read (value None) or write a key of the experiment's bus KV on the real nats-server; `run` scopes
    the names as in the experiment's pods (the kuberl.io/bus-run the operator pinned: `run_of`)."""
    import nats
    from nats.js.errors import KeyNotFoundError

    from kuberl.operator.progress import kv_bucket

    async def go() -> dict[str, Any] | None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            store = await js.create_key_value(bucket=kv_bucket(exp, run))
            if value is not None:
                await store.put(key, json.dumps(value).encode())
                return value
            try:
                return json.loads((await store.get(key)).value)
            except KeyNotFoundError:
                return None
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def api(kuberl_installed: Any) -> Iterator[Api]:
    if not kuberl_installed.local:
        pytest.skip("plays pods' containers through KWOK's stages: runs on the local control plane (KUBECONFIG unset)")
    yield Api(kuberl_installed.control_plane, kuberl_installed.operator)


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj["metadata"].get("ownerReferences") or [])


CHILDREN = [
    ("/api/v1/namespaces/default/configmaps/{e}-config"),
    ("/api/v1/namespaces/default/secrets/{e}-bus-credentials"),
    ("/api/v1/namespaces/default/secrets/{e}-engine-credentials"),
    ("/apis/apps/v1/namespaces/default/statefulsets/{e}-bus"),
    ("/apis/apps/v1/namespaces/default/statefulsets/{e}-rollout"),
    ("/apis/batch/v1/namespaces/default/jobs/{e}-trainer"),
    ("/api/v1/namespaces/default/serviceaccounts/{e}-runtime"),
]
CHECKPOINT_PVC = "/api/v1/namespaces/default/persistentvolumeclaims/{e}-checkpoints"
BUS_PVC = "/api/v1/namespaces/default/persistentvolumeclaims/data-{e}-bus-0"


def test_an_experiment_gets_owned_children_and_runs_through_initializing_running_succeeded(api: Api, experiment_name: str) -> None:
    e = experiment_name
    # The engine's container is held in ContainerCreating (KWOK's pod-waiting stage), so the first status write sees a
    # role on its way up however fast the fake nodes make the other pods Ready (without the hold, a busy machine let the
    # first status write find every pod Ready already: Pending -> Running, no Initializing to see).
    held = {"kwok.kuberl.io/waiting-reason": "ContainerCreating"}
    uid = api.call("POST", RLX, manifest(e, rollout={"podTemplate": {"annotations": held}}))["metadata"]["uid"]
    for path in CHILDREN:
        child = api.wait(path.format(e=e), lambda p=path: api.get(p.format(e=e)))
        assert owned_by(child, uid), f"{path.format(e=e)} is not owned by the experiment: {child['metadata'].get('ownerReferences')}"
    pvc = api.wait("checkpoint PVC", lambda: api.get(CHECKPOINT_PVC.format(e=e)))
    assert not pvc["metadata"].get("ownerReferences"), "checkpoint.retainPolicy Retain (the default): the PVC outlives the experiment"
    assert api.wait("phase Initializing", lambda: api.phase(e) == "Initializing")
    api.wait("the engine's pod", lambda: api.get(f"/api/v1/namespaces/{NS}/pods/{e}-rollout-0"))
    api.merge(f"/api/v1/namespaces/{NS}/pods/{e}-rollout-0", {"metadata": {"annotations": {k: None for k in held}}})
    assert api.wait("phase Running", lambda: api.phase(e) == "Running")
    status = api.experiment(e)["status"]
    assert {"type": "Ready", "status": "True"}.items() <= next(c for c in status["conditions"] if c["type"] == "Ready").items()
    assert status["observedGeneration"] == api.experiment(e)["metadata"]["generation"]
    assert api.wait("the bus server's volume", lambda: api.get(BUS_PVC.format(e=e)))
    api.finish_job(e)
    assert api.wait("phase Succeeded", lambda: api.phase(e) == "Succeeded")
    assert api.experiment(e)["status"].get("completionTime")
    assert api.wait("rollout scaled to 0", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 0)
    reasons = api.wait("phase events", lambda: {"PhaseInitializing", "PhaseRunning", "PhaseSucceeded"} <= api.event_reasons(e) and api.event_reasons(e))
    assert "Created" in reasons
    # bus.embedded.afterSuccess Delete (the default): no bus server, and the StatefulSet controller deletes its volume;
    # the checkpoint volume stays (retainPolicy Retain) and an event says it bills until deleted.
    assert api.wait("the bus stopped", lambda: api.sts(f"{e}-bus")["spec"]["replicas"] == 0)
    api.wait("the bus server's volume deleted", lambda: api.get(BUS_PVC.format(e=e)) is None, timeout=30)
    assert api.get(CHECKPOINT_PVC.format(e=e)) is not None
    notes = api.wait("BusStopped and CheckpointRetained events", lambda: {x["reason"]: x["message"] for x in api.events(e)
                                                                          if x["reason"] in ("BusStopped", "CheckpointRetained")})
    assert f"kubectl delete pvc {e}-checkpoints" in notes["CheckpointRetained"] and "volumes are deleted" in notes["BusStopped"], notes


def test_a_missing_hub_token_secret_sets_a_condition_and_an_event_and_the_operator_keeps_running(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e, model={"hubTokenSecret": {"name": f"{e}-hf", "key": "token"}}))
    api.wait("a SecretNotFound event", lambda: "SecretNotFound" in api.event_reasons(e))
    cond = api.wait("a condition naming the Secret", lambda: next(
        (c for c in (api.experiment(e).get("status") or {}).get("conditions", []) if f"{e}-hf" in (c.get("message") or "")), None))
    assert cond["status"] in ("True", "False") and cond["reason"] == "SecretNotFound"
    assert api.sts(f"{e}-rollout") is None, "no pods may be created before the Secret exists"
    assert api.operator.alive
    api.call("POST", "/api/v1/namespaces/default/secrets", {"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": f"{e}-hf"}, "data": {"token": "aGY="}})
    api.wait("children once the Secret exists", lambda: api.sts(f"{e}-rollout"), timeout=60)


def test_a_name_too_long_for_the_children_is_refused_at_admission(api: Api) -> None:
    """A valid Kubernetes name, but too long for the children's names (metadata.name <= 52): the CRD's schema refuses
    it, so no experiment exists that the operator would have to fail."""
    r = api.http.post(api.url + RLX, data=json.dumps(manifest("x" * 60)), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "metadata.name" in r.text and "52" in r.text, r.text[:500]
    r = api.http.post(api.url + RLX, data=json.dumps(manifest("7x")), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "metadata.name" in r.text, "a name that starts with a digit cannot name Services"


def test_scaling_through_the_scale_subresource_changes_the_rollout_statefulset(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e))
    api.wait("rollout StatefulSet", lambda: api.sts(f"{e}-rollout"))
    scale = api.merge(f"{RLX}/{e}/scale", {"spec": {"replicas": 3}})
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert api.experiment(e)["spec"]["rollout"]["replicas"] == 3
    api.wait("StatefulSet replicas 3", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 3)
    api.wait("status.replicas 3 for the /scale subresource", lambda: (api.experiment(e).get("status") or {}).get("replicas") == 3)
    assert api.get(f"{RLX}/{e}/scale")["status"]["selector"]


def run_of(api: Api, name: str) -> str:
    """The bus run of an experiment: its namespace and uid (what the operator pins as kuberl.io/bus-run)."""
    meta = api.experiment(name)["metadata"]
    return f"{meta['namespace']}.{meta['uid'].replace('-', '')[:12]}"


def test_suspend_checkpoints_then_suspends_the_job_and_scales_rollout_to_zero_and_resume_restores_them(
        api: Api, experiment_name: str, nats_server: Any) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e, bus={"external": {"url": nats_server.url}}))
    run = run_of(api, e)
    kv(nats_server.url, e, "progress", {"step": 3, "total_steps": 10, "policy_version": 3, "done": False, "failed": None,
                                        "checkpoint": None, "time": time.time()}, run=run)
    api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))
    api.wait("phase Running", lambda: api.phase(e) == "Running")
    api.merge(f"{RLX}/{e}", {"spec": {"suspend": True}})
    # Play the trainer: answer the checkpoint request on the real bus.
    request = api.wait("control.checkpoint_request on the bus", lambda: (kv(nats_server.url, e, "control", run=run) or {}).get("checkpoint_request"))
    assert not api.job(f"{e}-trainer")["spec"].get("suspend"), "the Job must keep running until the checkpoint is written"
    kv(nats_server.url, e, "progress", {"step": 3, "total_steps": 10, "policy_version": 3, "done": False, "failed": None, "time": time.time(),
                                        "checkpoint": {"step": 3, "policy_version": 3, "path": "/checkpoints/step-00000003", "time": time.time()}},
       run=run)
    api.wait("Job suspended", lambda: api.job(f"{e}-trainer")["spec"].get("suspend") is True)
    api.wait("rollout at 0", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 0)
    # The Job controller deletes the trainer's pods and reports Suspended; the StatefulSet controller its 0 replicas.
    api.wait("phase Suspended", lambda: api.phase(e) == "Suspended")
    assert {"CheckpointRequested", "CheckpointSaved", "Suspended"} <= api.event_reasons(e), request
    api.merge(f"{RLX}/{e}", {"spec": {"suspend": False}})
    api.wait("Job resumed", lambda: not api.job(f"{e}-trainer")["spec"].get("suspend"))
    api.wait("rollout back to 1", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 1)
    api.wait("phase Running again", lambda: api.phase(e) == "Running")
    api.wait("a Resumed event", lambda: "Resumed" in api.event_reasons(e))


def test_the_autoscaler_scales_rollout_from_real_bus_progress_and_explains_why(api: Api, experiment_name: str, nats_server: Any) -> None:
    e = experiment_name
    progress = {"step": 5, "total_steps": 100, "policy_version": 5, "trainer_wait_fraction": 0.9, "groups_buffered": 0,
                "samples_per_second": 1.0, "done": False, "failed": None, "checkpoint": None, "time": time.time()}
    api.call("POST", RLX, manifest(e, bus={"external": {"url": nats_server.url}},
                                   rollout={"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "cooldownSeconds": 0}}))
    kv(nats_server.url, e, "progress", progress, run=run_of(api, e))
    api.wait("rollout StatefulSet", lambda: api.sts(f"{e}-rollout"))
    api.wait("phase Running", lambda: api.phase(e) == "Running")
    api.wait("a scale-up to 2 driven by the trainer waiting", lambda: api.experiment(e)["spec"]["rollout"]["replicas"] >= 2)
    api.wait("StatefulSet follows", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] >= 2)
    scaled = api.wait("a ScaledUp event", lambda: [ev for ev in api.events(e) if ev["reason"] == "ScaledUp"])
    assert "->" in scaled[0]["message"] and len(scaled[0]["message"]) > 20, scaled[0]["message"]
    assert "kuberl_operator_scale_decisions_total" in api.operator.metrics()


def test_a_failed_trainer_is_restarted_with_backoff_and_then_the_experiment_fails(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e, failurePolicy={"maxRestarts": 1, "backoffSeconds": 1}))
    first = api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))["metadata"]["uid"]
    api.finish_job(e, "Failed")
    second = api.wait("a new trainer Job", lambda: (j := api.job(f"{e}-trainer")) and j["metadata"]["uid"] != first and j)
    assert api.wait("status.restarts 1", lambda: (api.experiment(e).get("status") or {}).get("restarts") == 1)
    assert "TrainerRestarted" in api.event_reasons(e)
    api.finish_job(e, "Failed")
    api.wait("phase Failed after maxRestarts", lambda: api.phase(e) == "Failed")
    assert api.job(f"{e}-trainer")["metadata"]["uid"] == second["metadata"]["uid"], "no restart beyond maxRestarts"
    # The engines would otherwise hold their accelerators for an experiment that cannot go on.
    api.wait("rollout scaled to 0", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 0)
    assert "Stopped" in api.event_reasons(e)


def test_a_trainer_that_reports_a_retryable_failure_is_restarted_and_the_experiment_does_not_fail(
        api: Api, experiment_name: str, nats_server: Any) -> None:
    """contracts.md: a failure at run time (exit 1) is retried under failurePolicy. The trainer reports it in
    progress.failed on the bus before it exits; that report must read as a restart, not as a terminal Failed phase
    (a terminal phase stays terminal while the restarted trainer trains on)."""
    e = experiment_name
    api.call("POST", RLX, manifest(e, bus={"external": {"url": nats_server.url}}, failurePolicy={"maxRestarts": 1, "backoffSeconds": 1}))
    run = run_of(api, e)
    base = {"step": 3, "total_steps": 10, "policy_version": 3, "done": False, "failed": None, "checkpoint": None}
    kv(nats_server.url, e, "progress", {**base, "time": time.time()}, run=run)
    first = api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))["metadata"]["uid"]
    api.wait("phase Running", lambda: api.phase(e) == "Running")

    def degraded() -> dict | None:
        return next((c for c in (api.experiment(e).get("status") or {}).get("conditions", []) if c["type"] == "Degraded"), None)

    # Play the trainer: it reports the failure on the real bus, then exits 1 and its Job fails.
    kv(nats_server.url, e, "progress", {**base, "failed": "NatsError: nats: timeout", "time": time.time()}, run=run)
    api.wait("Degraded: TrainerRestarting", lambda: (c := degraded()) and c["status"] == "True" and c["reason"] == "TrainerRestarting")
    assert api.phase(e) == "Running" and "NatsError: nats: timeout" in degraded()["message"]
    api.finish_job(e, "Failed")
    api.wait("a new trainer Job", lambda: (j := api.job(f"{e}-trainer")) and j["metadata"]["uid"] != first)
    # The restarted trainer resumes and reports again, without the failure.
    kv(nats_server.url, e, "progress", {**base, "step": 4, "policy_version": 4, "time": time.time()}, run=run)
    api.wait("Running and no longer degraded", lambda: api.phase(e) == "Running" and (degraded() or {}).get("status") != "True")
    assert "Failed" not in {c["type"] for c in api.experiment(e)["status"]["conditions"] if c["status"] == "True"}


MEGATRON = "trainer.backend 'megatron' is not implemented by this trainer yet; use trainer.backend fsdp"


def test_a_trainer_configuration_error_fails_the_experiment_at_once_with_its_message_and_no_restart(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e, failurePolicy={"maxRestarts": 3, "backoffSeconds": 1}))
    job = api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2], "the policy reaches the API server"
    api.wait("phase Running", lambda: api.phase(e) == "Running")
    # The trainer exits 2 with its termination message; the Job controller's pod failure policy fails the Job.
    uid = job["metadata"]["uid"]
    api.finish_job(e, "Failed", code=2, message=MEGATRON)
    failed_job = api.wait("the Job Failed by its pod failure policy", lambda: next(
        (c for c in (api.job(f"{e}-trainer").get("status") or {}).get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"), None))
    assert failed_job["reason"] == "PodFailurePolicy", failed_job
    api.wait("phase Failed", lambda: api.phase(e) == "Failed")
    status = api.experiment(e)["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "ConfigurationError" and MEGATRON in failed["message"], failed
    ev = api.wait("a ConfigurationError event", lambda: [x for x in api.events(e) if x["reason"] == "ConfigurationError"])
    assert ev[0]["type"] == "Warning" and ev[0]["message"] == failed["message"]
    api.wait("rollout scaled to 0", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 0)
    time.sleep(4)  # several monitor ticks, well past backoffSeconds: a restart would have happened by now
    assert api.job(f"{e}-trainer")["metadata"]["uid"] == uid, "a configuration error must not re-create the trainer Job"
    assert (api.experiment(e)["status"].get("restarts") or 0) == 0 and "TrainerRestarted" not in api.event_reasons(e)
    assert len([x for x in api.events(e) if x["reason"] == "ConfigurationError"]) == 1
    assert api.phase(e) == "Failed"
    # A failed experiment stops its bus server but keeps its volume (what was accepted and not trained) until deleted.
    assert api.sts(f"{e}-bus")["spec"]["replicas"] == 0 and api.get(BUS_PVC.format(e=e)) is not None


def test_a_rollout_configuration_error_fails_the_experiment_instead_of_crash_looping(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e))
    api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))
    api.wait("phase Running", lambda: api.phase(e) == "Running")
    reason = "model.path: '/models/models/qwen' is not a folder"
    # The engine exits 2; the StatefulSet's pod restarts it and waits in CrashLoopBackOff (KWOK's pod-exit stage).
    api.wait("rollout pod Running", lambda: [p for p in api.pods(f"kuberl.io/experiment={e},kuberl.io/role=rollout")
                                             if p["status"].get("phase") == "Running"])
    api.cp.exit(NS, [f"{e}-rollout-0"], 2, reason)
    api.wait("phase Failed", lambda: api.phase(e) == "Failed")
    failed = next(c for c in api.experiment(e)["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "ConfigurationError" and reason in failed["message"] and f"{e}-rollout-0" in failed["message"]
    assert [x["message"] for x in api.events(e) if x["reason"] == "ConfigurationError"] == [failed["message"]]
    api.wait("rollout scaled to 0", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 0)
    api.wait("the waiting trainer stopped (Job suspended)", lambda: api.job(f"{e}-trainer")["spec"].get("suspend") is True)


def test_deleting_the_experiment_garbage_collects_its_children(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e))
    for path in CHILDREN:
        api.wait(path.format(e=e), lambda p=path: api.get(p.format(e=e)))
    api.call("DELETE", f"{RLX}/{e}")
    api.wait("the experiment gone (kopf's finalizer released)", lambda: api.experiment(e) is None)
    for path in CHILDREN:
        api.wait(f"{path.format(e=e)} collected", lambda p=path: api.get(p.format(e=e)) is None, timeout=20)
    assert api.get(CHECKPOINT_PVC.format(e=e)) is not None, "retainPolicy Retain keeps the checkpoints"


def test_checkpoint_retain_policy_delete_collects_the_pvc_with_the_experiment(api: Api, experiment_name: str) -> None:
    e = experiment_name
    uid = api.call("POST", RLX, manifest(e, checkpoint={"retainPolicy": "Delete"}))["metadata"]["uid"]
    pvc = api.wait("checkpoint PVC", lambda: api.get(CHECKPOINT_PVC.format(e=e)))
    assert owned_by(pvc, uid)
    api.call("DELETE", f"{RLX}/{e}")
    api.wait("the checkpoint PVC collected", lambda: api.get(CHECKPOINT_PVC.format(e=e)) is None, timeout=30)


def test_a_finished_experiment_is_deleted_after_its_ttl(api: Api, experiment_name: str) -> None:
    e = experiment_name
    api.call("POST", RLX, manifest(e, ttlSecondsAfterFinished=2))
    api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))
    api.finish_job(e)
    api.wait("phase Succeeded", lambda: api.phase(e) == "Succeeded")
    api.wait("deleted after ttlSecondsAfterFinished", lambda: api.experiment(e) is None, timeout=30)


def test_the_operator_serves_prometheus_metrics(api: Api) -> None:
    text = api.operator.metrics()
    assert "kuberl_operator_reconciles_total" in text and 'kuberl_operator_experiments{phase="Running"}' in text


def test_an_image_pull_error_of_a_pod_becomes_a_condition_and_an_event(api: Api, experiment_name: str) -> None:
    e = experiment_name
    # The engine's image cannot be pulled: KWOK keeps the pod Pending with its containers waiting in ImagePullBackOff.
    api.call("POST", RLX, manifest(e, rollout={"image": "ghcr.io/kuberl/nope:1", "podTemplate": {"annotations": {
        "kwok.kuberl.io/waiting-reason": "ImagePullBackOff", "kwok.kuberl.io/message": "Back-off pulling image"}}}))
    api.wait("rollout StatefulSet", lambda: api.sts(f"{e}-rollout"))
    ev = api.wait("an ImagePullFailed event", lambda: [x for x in api.events(e) if x["reason"] == "ImagePullFailed"])
    assert "ghcr.io/kuberl/nope:1" in ev[0]["message"]
    api.wait("a condition naming the image", lambda: any("nope:1" in (c.get("message") or "") and c["reason"] == "ImagePullFailed"
                                                         for c in (api.experiment(e).get("status") or {}).get("conditions", [])))


def test_more_accelerators_than_any_node_has_still_creates_the_pods_and_says_so(api: Api, experiment_name: str) -> None:
    """B1: a node pool scaling from zero has no GPU node until a pod is pending, so the operator must
    create the pods (the autoscaler reacts to them) and only report the capacity it sees."""
    e = experiment_name
    api.call("POST", RLX, manifest(e, rollout={"accelerator": {"type": "nvidia", "count": 16}, "tensorParallelSize": 16}))
    sts = api.wait("the rollout StatefulSet, created although no node has 16 GPUs", lambda: api.sts(f"{e}-rollout"))
    limits = [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in sts["spec"]["template"]["spec"]["containers"]]
    assert 16 in limits or "16" in limits, limits
    api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))
    ev = api.wait("an InsufficientAccelerators event", lambda: [x for x in api.events(e) if x["reason"] == "InsufficientAccelerators"])
    assert ev[0]["type"] == "Warning" and "16" in ev[0]["message"] and "largest: 8" in ev[0]["message"], ev[0]["message"]
    ready = api.wait("a Ready message with the note", lambda: next((c for c in (api.experiment(e).get("status") or {}).get("conditions", [])
                                                                     if c["type"] == "Ready" and "autoscaler" in c["message"]), None))
    assert api.phase(e) in ("Pending", "Initializing") and ready["status"] == "False"
    # A node with 16 GPUs joins (a pool scaled up): the operator's Node watch sees it at the next tick (it used to list
    # every Node once a minute), and the note goes. Its CPU is too small for the pod, so the pod stays Pending and only the
    # operator's view of the Nodes can clear the note. The operator never lists Nodes on its own: it watches them.
    node = f"{e[:40]}-gpu16"
    h100 = NODE_POOLS["h100"]
    api.cp.add_nodes({node: (1, h100[1], h100[2], {"cpu": "100m", "memory": "64Mi", "pods": "110", "nvidia.com/gpu": "16"})})
    try:
        api.wait("the note gone once a 16-GPU node exists", lambda: not any(
            "autoscaler" in (c.get("message") or "") for c in (api.experiment(e).get("status") or {}).get("conditions", [])), timeout=20)
    finally:
        api.cp.kubectl("delete", "node", f"{node}-0", "--wait=false")
    operator = {ev["user"]["username"] for ev in api.cp.audit_events() if ev["user"]["username"].startswith("system:serviceaccount:kuberl-system:")}
    reads = [(ev["verb"], (ev.get("objectRef") or {}).get("resource")) for ev in api.cp.audit_events()
             if ev["user"]["username"] in operator and (ev.get("objectRef") or {}).get("resource") == "nodes"]
    assert ("watch", "nodes") in reads and sum(verb == "list" for verb, _ in reads) <= 2, reads


def test_an_allocation_the_spec_contradicts_is_refused_at_admission_and_the_fixed_one_runs(api: Api, experiment_name: str) -> None:
    """B3: 4 trainer GPUs do not split into nodes of 3. The API server refuses it (CEL, naming the field), so no
    experiment exists that the operator would have to fail; the fixed spec runs with the allocation's 2 engines."""
    e = experiment_name
    m = manifest(e, allocation="vllm:d2+fsdp:d4", rollout={"accelerator": {"type": "nvidia"}}, trainer={"accelerator": {"type": "nvidia", "count": 3}})
    del m["spec"]["rollout"]["replicas"]
    r = api.http.post(api.url + RLX, data=json.dumps(m), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "spec.trainer.accelerator.count" in r.text and "do not split into nodes" in r.text, r.text[:500]
    m["spec"]["trainer"]["accelerator"]["count"] = 4
    api.call("POST", RLX, m)
    api.wait("the trainer Job", lambda: api.job(f"{e}-trainer"), timeout=30)
    api.wait("rollout at the allocation's 2 engines", lambda: (api.sts(f"{e}-rollout") or {}).get("spec", {}).get("replicas") == 2)
    api.wait("phase Running", lambda: api.phase(e) == "Running")
    assert api.experiment(e)["spec"]["rollout"]["replicas"] == 2, "the operator wrote the resolved count for /scale"
    # The operator's own spec.rollout.replicas write bumped the generation: observedGeneration names it (it used to stay
    # one behind when a monitor tick, started before the reconcile, wrote its stale status; tests/unit/test_operator_scale.py).
    api.wait("observedGeneration caught up", lambda: (x := api.experiment(e))["status"].get("observedGeneration") == x["metadata"]["generation"],
             timeout=60)


def test_an_immutable_child_field_is_reported_and_the_rest_applied(api: Api, experiment_name: str) -> None:
    """B8: bus.embedded.storage lives in the bus StatefulSet's volumeClaimTemplates (immutable). The
    edit must not stop the other children (rollout replicas here) and must show as Reconciled=False
    ApplyFailed naming the field, with observedGeneration left at the last generation fully applied."""
    e = experiment_name
    api.call("POST", RLX, manifest(e))
    api.wait("bus StatefulSet", lambda: api.sts(f"{e}-bus"))
    applied = api.wait("observedGeneration 1+", lambda: (api.experiment(e).get("status") or {}).get("observedGeneration"))
    api.merge(f"{RLX}/{e}", {"spec": {"bus": {"embedded": {"storage": "20Gi"}}, "rollout": {"replicas": 2}}})
    generation = api.experiment(e)["metadata"]["generation"]
    cond = api.wait("Reconciled=False", lambda: next((c for c in (api.experiment(e).get("status") or {}).get("conditions", [])
                                                        if c["type"] == "Reconciled" and c["status"] == "False"), None))
    assert cond["reason"] == "ApplyFailed" and "volumeClaimTemplates" in cond["message"], cond
    api.wait("the rest applied: rollout at 2", lambda: api.sts(f"{e}-rollout")["spec"]["replicas"] == 2)
    assert api.experiment(e)["status"]["observedGeneration"] == applied < generation
    ev = api.wait("an ApplyFailed event", lambda: [x for x in api.events(e) if x["reason"] == "ApplyFailed"])
    assert "volumeClaimTemplates" in ev[0]["message"]
    api.merge(f"{RLX}/{e}", {"spec": {"bus": {"embedded": {"storage": None}}}})  # back to the default
    api.wait("Reconciled=True and observedGeneration caught up", lambda: (s := api.experiment(e).get("status") or {})
             and s.get("observedGeneration") == api.experiment(e)["metadata"]["generation"]
             and any(c["type"] == "Reconciled" and c["status"] == "True" for c in s.get("conditions", [])),
             timeout=180)


def test_an_edit_the_api_server_refuses_for_the_job_keeps_the_running_trainer(api: Api, experiment_name: str) -> None:
    """A trainer pod template the Job's validation refuses (here a configMap volume that names no ConfigMap, which the
    CRD's open volume schema and the chart's admission policy admit) is reported; the healthy trainer is neither deleted nor re-created. A valid template
    change, immutable in a Job, still re-creates it."""
    e = experiment_name
    api.call("POST", RLX, manifest(e))
    uid = api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))["metadata"]["uid"]
    api.trainer_pods(e)
    api.merge(f"{RLX}/{e}", {"spec": {"trainer": {"podTemplate": {"volumes": [{"name": "scratch", "configMap": {}}]}}}})
    cond = api.wait("Reconciled=False", lambda: next((c for c in (api.experiment(e).get("status") or {}).get("conditions", [])
                                                        if c["type"] == "Reconciled" and c["status"] == "False"), None))
    assert cond["reason"] == "ApplyFailed" and "configMap.name" in cond["message"], cond
    ev = api.wait("an ApplyFailed event", lambda: [x for x in api.events(e) if x["reason"] == "ApplyFailed"])
    assert "configMap.name" in ev[0]["message"], ev[0]
    time.sleep(3)  # several reconciles: the Job stays
    assert api.job(f"{e}-trainer")["metadata"]["uid"] == uid and "Recreated" not in api.event_reasons(e)
    api.merge(f"{RLX}/{e}", {"spec": {"trainer": {"podTemplate": {"volumes": [{"name": "scratch", "emptyDir": {}}]}}}})
    new = api.wait("the Job re-created for the valid change", lambda: (j := api.job(f"{e}-trainer")) and j["metadata"]["uid"] != uid and j)
    assert any(v["name"] == "scratch" for v in new["spec"]["template"]["spec"]["volumes"])
    assert "Recreated" in api.event_reasons(e)


def test_a_pod_template_field_the_api_server_does_not_know_is_reported_not_retried_forever(api: Api, experiment_name: str) -> None:
    """A misspelt field inside an extra volume (the CRD keeps volumes open, as core/v1 Volume is large): server-side apply
    of the rollout StatefulSet answers 500 "failed to create typed patch object ... field not declared in schema" (no
    400/422), which the operator took for a server fault and retried forever without a word. It is the spec's fault: an
    ApplyFailed condition and event name the field; the other children are applied."""
    e = experiment_name
    volumes = [{"name": "scratch", "emptyDir": {"sizeLimt": "1Gi"}}]
    api.call("POST", RLX, manifest(e, rollout={"podTemplate": {"volumes": volumes, "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}}))
    cond = api.wait("Reconciled=False", lambda: next((c for c in (api.experiment(e).get("status") or {}).get("conditions", [])
                                                        if c["type"] == "Reconciled" and c["status"] == "False"), None))
    assert cond["reason"] == "ApplyFailed" and "sizeLimt" in cond["message"] and f"StatefulSet/{e}-rollout" in cond["message"], cond
    assert api.wait("the trainer Job applied all the same", lambda: api.job(f"{e}-trainer"))
    ev = api.wait("an ApplyFailed event", lambda: [x for x in api.events(e) if x["reason"] == "ApplyFailed"])
    assert "sizeLimt" in ev[0]["message"], ev[0]


def test_a_job_judged_failed_restarts_before_its_last_pod_is_gone_and_no_old_pod_meets_the_new_job(api: Api, experiment_name: str) -> None:
    """Rank 0 fails; the Job controller sets FailureTarget and deletes rank 1, whose pod stays terminating (a long grace
    period, a node that stopped answering). The operator reacts to FailureTarget at once, and creates the new Job only
    once that pod is gone: a terminating old rank must never answer the new rank 0's name."""
    e = experiment_name
    api.call("POST", RLX, manifest(e, trainer={"nodes": 2}, failurePolicy={"maxRestarts": 2, "backoffSeconds": 1}))
    first = api.wait("trainer Job", lambda: api.job(f"{e}-trainer"))["metadata"]["uid"]
    pods = sorted(api.trainer_pods(e))
    rank0 = next(p for p in pods if p.startswith(f"{e}-trainer-0-"))
    rank1 = next(p for p in pods if p != rank0)
    api.cp.hold_termination(NS, [rank1])
    api.cp.exit(NS, [rank0], 1)
    api.wait("FailureTarget while rank 1 terminates", lambda: any(
        c["type"] == "FailureTarget" and c["status"] == "True" for c in ((api.job(f"{e}-trainer") or {}).get("status") or {}).get("conditions", [])))
    assert not any(c["type"] == "Failed" for c in api.job(f"{e}-trainer")["status"].get("conditions", []))
    api.wait("status.restarts 1 (the operator reacted to FailureTarget)", lambda: (api.experiment(e).get("status") or {}).get("restarts") == 1)
    assert "TrainerRestarted" in api.event_reasons(e)
    held = api.get(f"/api/v1/namespaces/{NS}/pods/{rank1}")
    assert held is not None and held["metadata"].get("deletionTimestamp"), "rank 1 must still be terminating for this test"
    time.sleep(3)
    job = api.job(f"{e}-trainer")
    assert job is None or job["metadata"]["uid"] == first, "a new trainer Job was created while an old rank still terminated"
    api.cp.hold_termination(NS, [rank1], hold=False)
    new = api.wait("the new trainer Job", lambda: (j := api.job(f"{e}-trainer")) and j["metadata"]["uid"] != first and j, timeout=90)
    assert api.get(f"/api/v1/namespaces/{NS}/pods/{rank1}") is None
    assert new["spec"]["parallelism"] == 2
    api.trainer_pods(e)  # both ranks of the new Job run
    assert (api.experiment(e)["status"].get("restarts")) == 1, "\n".join(f"{x['reason']}: {x['message']} x{x.get('count')}" for x in api.events(e))


def test_a_volume_no_storage_class_will_provision_is_a_condition_and_an_event_naming_the_field(api: Api, experiment_name: str) -> None:
    """A StorageClass that does not exist leaves the checkpoint and bus volumes Pending forever (on EKS since 1.30 so does
    naming none: no default class). The experiment says which volume, why, and which field to set."""
    e = experiment_name
    api.call("POST", RLX, manifest(e, checkpoint={"size": "1Gi", "storageClassName": "no-such-class"},
                                   bus={"embedded": {"storageClassName": "no-such-class"}}))
    ready = api.wait("Ready=False VolumePending", lambda: next((c for c in (api.experiment(e).get("status") or {}).get("conditions", [])
                                                                   if c["type"] == "Ready" and c["reason"] == "VolumePending"), None))
    assert "spec.checkpoint.storageClassName" in ready["message"] and "spec.bus.embedded.storageClassName" in ready["message"], ready
    assert "StorageClass 'no-such-class' does not exist" in ready["message"]
    ev = api.wait("VolumePending events", lambda: [x for x in api.events(e) if x["reason"] == "VolumePending"])
    assert any(f"PersistentVolumeClaim '{e}-checkpoints' is Pending" in x["message"] for x in ev), ev
