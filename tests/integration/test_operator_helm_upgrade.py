"""An operator upgrade (`helm upgrade`: a new version, new builder output, another image repository)
rolls no running experiment and re-creates no trainer Job; the user's own spec change, or the opt-in
annotation, does. Also: children carry only their own labels (a Kueue queue label on the experiment
stays there), and the generated engine key survives every reconcile.

The reconcile code (lifecycle.apply_children) runs in the test process, so a test can swap the operator's builders
mid-run as an upgrade does, against the real control plane (tests/integration/inprocess.py): the API server defaults
the pod templates and refuses a change to a Job's template (422) itself, and the StatefulSet and Job controllers run
the pods (KWOK), so "unchanged" here means unchanged as a cluster stores it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

import kuberl
from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator.builders import bus as bus_builder
from kuberl.operator.builders import common
from kuberl.operator.builders import rollout as rollout_builder
from kuberl.operator.builders import trainer as trainer_builder
from kuberl.operator.builders.rollout import ENGINE_API_KEY_KEY, ENGINE_CONTAINER
from kuberl.runtime.inference.engine_auth import API_KEY_ENV
from tests.integration import inprocess as ip
from tests.unit.operator_run import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NS = "inproc-upgrade"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
cluster = ip.namespace_fixture(NS)


@pytest.fixture
def operator(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The operator's module state pointed at the cluster, as `kuberl operator` version 0.1.0 sets it."""
    monkeypatch.setattr(kuberl, "__version__", "0.1.0")
    monkeypatch.setattr(h.CONFIG, "kube", ip.client_for(cluster))
    monkeypatch.setattr(h.CONFIG, "bus", NoBus())
    common.configure_images(None)
    yield
    ip.close_client()
    common.configure_images(None)


def create(name: str, labels: dict[str, str] | None = None) -> None:
    ip.create(ip.experiment(name, NS, {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
        "rollout": {"replicas": 2, "accelerator": {"type": "cpu", "count": 0}},
        "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "weightSync": {"mode": "bus"}}, labels))


def get(kind: str, name: str) -> dict | None:
    return run(h.kube().get(kind, NS, name))


def reconcile(name: str) -> dict:
    """One on_reconcile's apply, with the body as the operator would get it now."""
    body = get("RLExperiment", name)
    exp = handlers.parse_experiment(body)
    failures = run(h.apply_children(body, exp, dict(body.get("status") or {}), {}))
    assert failures == [], failures
    return body


def patch_experiment(name: str, patch: dict) -> None:
    run(h.kube().patch("RLExperiment", NS, name, patch))


def templates(name: str) -> dict[str, Any]:
    """What the pods run: the workloads' pod templates, experiment.yaml, nats.conf, the Job's uid, the Secrets."""
    rollout, bus, job = get("StatefulSet", f"{name}-rollout"), get("StatefulSet", f"{name}-bus"), get("Job", f"{name}-trainer")
    return {
        "rollout": copy.deepcopy(rollout["spec"]["template"]), "bus": copy.deepcopy(bus["spec"]["template"]),
        "trainer": copy.deepcopy(job["spec"]["template"]), "job uid": job["metadata"]["uid"],
        "config": get("ConfigMap", f"{name}-config")["data"], "secret": secret_values(get("Secret", f"{name}-bus-credentials")),
        "engine key": secret_values(get("Secret", f"{name}-engine-credentials"))[ENGINE_API_KEY_KEY],
    }


def secret_values(secret: dict) -> dict:
    """The Secret's values (the API server turns stringData into base64 data)."""
    import base64

    assert "stringData" not in secret
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def images(template: dict) -> set[str]:
    return {c["image"] for c in template["spec"]["containers"]}


def upgrade_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a `helm upgrade` changes in the operator: its version (the default image tag), the runtime
    image repository, and builder output (the trainer's command, the agent's resources, the NATS
    image, experiment.yaml's header)."""
    monkeypatch.setattr(kuberl, "__version__", "0.2.0")
    common.configure_images("mirror.example/kuberl")
    monkeypatch.setattr(trainer_builder, "TORCHRUN", [*trainer_builder.TORCHRUN, "--new-flag"])
    monkeypatch.setattr(rollout_builder, "AGENT_RESOURCES", {"requests": {"cpu": "1", "memory": "2Gi"}})
    monkeypatch.setattr(bus_builder, "NATS_IMAGE", "nats:2.16-alpine")
    from kuberl.operator.builders import config

    monkeypatch.setattr(config, "_HEADER", config._HEADER + "# written by operator 0.2.0\n")


class TestHelmUpgrade:
    def test_an_operator_upgrade_changes_no_pod_template_and_recreates_no_job(self, operator, monkeypatch) -> None:
        """Also the engine key: generated once, kept by every reconcile (restarted engines and agents must keep
        agreeing), in the engine Secret only, read by secretKeyRef."""
        create("up1")
        reconcile("up1")
        before = templates("up1")
        assert images(before["trainer"]) == {"ghcr.io/kuberl/runtime-cpu:0.1.0"}
        assert len(before["engine key"]) >= 32
        reconcile("up1")
        assert templates("up1") == before
        upgrade_the_operator(monkeypatch)
        reconcile("up1")  # on.resume after the new operator starts
        after = templates("up1")
        assert after == before
        rollout = get("StatefulSet", "up1-rollout")
        assert before["engine key"] not in json.dumps(rollout)
        engine = {c["name"]: c for c in rollout["spec"]["template"]["spec"]["containers"]}[ENGINE_CONTAINER]
        assert {e["name"]: e.get("valueFrom") for e in engine["env"]}[API_KEY_ENV] == {
            "secretKeyRef": {"name": "up1-engine-credentials", "key": ENGINE_API_KEY_KEY}}

    def test_the_pins_are_written_once_on_the_experiment(self, operator, monkeypatch) -> None:
        create("up2")
        reconcile("up2")
        annotations = get("RLExperiment", "up2")["metadata"]["annotations"]
        uid = get("RLExperiment", "up2")["metadata"]["uid"].replace("-", "")
        assert annotations["kuberl.io/runtime-version"] == "0.1.0"
        assert annotations["kuberl.io/runtime-repository"] == "ghcr.io/kuberl"
        assert annotations["kuberl.io/bus-run"] == f"{NS}.{uid[:12]}"
        upgrade_the_operator(monkeypatch)
        reconcile("up2")
        assert get("RLExperiment", "up2")["metadata"]["annotations"]["kuberl.io/runtime-version"] == "0.1.0"

    def test_kubectl_scale_after_an_upgrade_scales_without_rolling(self, operator, monkeypatch) -> None:
        create("up3")
        reconcile("up3")
        before = templates("up3")
        upgrade_the_operator(monkeypatch)
        patch_experiment("up3", {"spec": {"rollout": {"replicas": 3}}})  # a new generation, same inputs
        reconcile("up3")
        assert get("StatefulSet", "up3-rollout")["spec"]["replicas"] == 3
        assert templates("up3") == before

    def test_the_users_own_spec_change_renders_anew_but_keeps_the_pinned_image(self, operator, monkeypatch) -> None:
        create("up4")
        reconcile("up4")
        before = templates("up4")
        upgrade_the_operator(monkeypatch)
        patch_experiment("up4", {"spec": {"rollout": {"engineArgs": ["--enforce-eager"]}}})
        reconcile("up4")
        after = templates("up4")
        assert after["rollout"] != before["rollout"] and after["config"] != before["config"]
        assert images(after["rollout"]) == images(before["rollout"]) == {"ghcr.io/kuberl/runtime-cpu:0.1.0"}
        assert images(after["trainer"]) == {"ghcr.io/kuberl/runtime-cpu:0.1.0"}

    def test_the_opt_in_annotation_moves_the_experiment_to_the_new_runtime(self, operator, monkeypatch) -> None:
        create("up5")
        reconcile("up5")
        upgrade_the_operator(monkeypatch)
        patch_experiment("up5", {"metadata": {"annotations": {"kuberl.io/runtime-version": "0.2.0",
                                                              "kuberl.io/runtime-repository": "mirror.example/kuberl"}}})
        reconcile("up5")
        assert images(templates("up5")["rollout"]) == {"mirror.example/kuberl/runtime-cpu:0.2.0"}

    def test_an_experiment_of_an_operator_before_pins_keeps_its_image_and_plain_bus_names(self, operator, monkeypatch) -> None:
        """The first upgrade to a pinning operator: the running workloads say what to pin."""
        create("up6")
        body = get("RLExperiment", "up6")
        legacy = handlers.parse_experiment(body)
        legacy.metadata.annotations.update({"kuberl.io/bus-run": ""})  # what an operator without runs rendered
        run(h.apply_children(body, legacy, {}, {}))
        run(h.kube().patch("RLExperiment", NS, "up6", {"metadata": {"annotations": {
            "kuberl.io/bus-run": None, "kuberl.io/runtime-version": None, "kuberl.io/runtime-repository": None}}}))
        before = templates("up6")
        upgrade_the_operator(monkeypatch)
        reconcile("up6")
        annotations = get("RLExperiment", "up6")["metadata"]["annotations"]
        assert (annotations["kuberl.io/runtime-version"], annotations["kuberl.io/bus-run"]) == ("0.1.0", "")
        assert templates("up6") == before


class TestChildLabels:
    def test_owner_labels_are_not_copied_onto_children(self, operator) -> None:
        """A Kueue queue label on the RLExperiment would make its trainer Job a Kueue workload of its own."""
        create("kq1", labels={QUEUE_LABEL: "team-a-queue", "team": "a"})
        reconcile("kq1")
        body = get("RLExperiment", "kq1")
        for kind, name in (("Job", "kq1-trainer"), ("StatefulSet", "kq1-rollout"), ("StatefulSet", "kq1-bus"),
                           ("ConfigMap", "kq1-config"), ("Service", "kq1-rollout")):
            child = get(kind, name)
            assert QUEUE_LABEL not in child["metadata"].get("labels", {}), (kind, name)
            assert "team" not in child["metadata"].get("labels", {}), (kind, name)
            refs = child["metadata"]["ownerReferences"]
            assert [(r["uid"], r["controller"], r["blockOwnerDeletion"]) for r in refs] == [(body["metadata"]["uid"], True, True)]
        job = get("Job", "kq1-trainer")
        assert QUEUE_LABEL not in job["spec"]["template"]["metadata"].get("labels", {})


class NoBus:
    """The bus as the operator finds it here: KWOK's pods run no NATS, so no trainer answers a checkpoint request."""

    async def request_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def read(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def close(self) -> None:
        return None


class FakeBus:
    """The operator's bus reader, answering a checkpoint request the way the trainer does (progress.checkpoint.time)."""

    def __init__(self, job_uid_at_request: list) -> None:
        self.requests: list[tuple[str, str]] = []
        self.asked_at: float | None = None
        self.job_uid_at_request = job_uid_at_request

    async def request_checkpoint(self, url, token, experiment, request_id, *, run=""):
        import time

        job = await h.kube().get("Job", NS, f"{experiment}-trainer")
        self.job_uid_at_request.append(job["metadata"]["uid"] if job else None)
        self.requests.append((experiment, run))
        self.asked_at = time.time()
        return True

    async def read(self, url, token, experiment, key="progress", *, run=""):
        if self.asked_at is None:
            return None
        return {"step": 12, "checkpoint": {"step": 12, "time": self.asked_at + 0.1, "path": "/checkpoints/step-12"}}

    async def close(self):
        return None


class TestTrainerRecreation:
    def test_a_running_trainer_checkpoints_before_its_job_is_recreated(self, operator, monkeypatch) -> None:
        create("rc1")
        reconcile("rc1")
        old_uid = get("Job", "rc1-trainer")["metadata"]["uid"]
        ip.wait_for("the trainer pod active", lambda: (get("Job", "rc1-trainer").get("status") or {}).get("active"))
        seen: list = []
        bus = FakeBus(seen)
        monkeypatch.setattr(h.CONFIG, "bus", bus)
        patch_experiment("rc1", {"spec": {"trainer": {"resources": {"requests": {"cpu": "2"}}}}})
        reconcile("rc1")
        run_id = get("RLExperiment", "rc1")["metadata"]["annotations"]["kuberl.io/bus-run"]
        assert bus.requests == [("rc1", run_id)]
        assert seen == [old_uid]  # asked while the old Job still ran
        assert get("Job", "rc1-trainer")["metadata"]["uid"] != old_uid

    def test_a_trainer_without_running_pods_is_recreated_without_asking(self, operator, monkeypatch, cluster) -> None:
        """No pod may start in the namespace (a ResourceQuota of 0 pods: the Job controller's creates are refused),
        so the trainer Job has no active pod."""
        quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods", "namespace": NS}, "spec": {"hard": {"pods": "0"}}}
        cluster.run("kubectl", "apply", "-f", "-", stdin=json.dumps(quota))
        try:
            create("rc2")
            reconcile("rc2")
            job = get("Job", "rc2-trainer")
            ip.wait_for("the Job controller's refused create", lambda: any(
                e["reason"] == "FailedCreate" and e["involvedObject"].get("uid") == job["metadata"]["uid"]
                for e in run(h.kube().list("Event", NS))))
            assert not (get("Job", "rc2-trainer").get("status") or {}).get("active")
            bus = FakeBus([])
            monkeypatch.setattr(h.CONFIG, "bus", bus)
            patch_experiment("rc2", {"spec": {"trainer": {"resources": {"requests": {"cpu": "2"}}}}})
            reconcile("rc2")
            assert bus.requests == []
            assert get("Job", "rc2-trainer")["metadata"]["uid"] != job["metadata"]["uid"]
        finally:
            cluster.run("kubectl", "delete", "resourcequota", "no-pods", "-n", NS, "--wait=true")


class TestGeneratedKeys:
    def test_the_episode_key_is_generated_once_and_kept_in_its_secret_only(self, operator) -> None:
        """workflow.external: a random key on the first reconcile, the same on the next (external agents that hold it
        keep working), and in no object but its Secret."""
        create("ext")
        patch_experiment("ext", {"spec": {"workflow": {"type": "agent", "external": {}}}})
        reconcile("ext")
        first = secret_values(get("Secret", "ext-episode-api"))[ENGINE_API_KEY_KEY]
        assert len(first) >= 32
        reconcile("ext")
        assert secret_values(get("Secret", "ext-episode-api"))[ENGINE_API_KEY_KEY] == first
        for kind, name in (("StatefulSet", "ext-rollout"), ("ConfigMap", "ext-config"), ("RLExperiment", "ext")):
            assert first not in json.dumps(get(kind, name)), kind
