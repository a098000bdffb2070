"""Specification of the RLExperiment status: phases, conditions, progress, unrunnable explanations."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kuberl.api import RLExperiment, RLExperimentStatus
from kuberl.operator.builders import (
    build_bus_statefulset,
    build_rollout_statefulset,
    build_trainer_job,
)
from kuberl.operator.labels import Reason
from kuberl.operator.status import (
    Applied,
    ConfigurationFailure,
    ObservedChildren,
    PodProblem,
    compute_status,
    configuration_error,
    explain_unrunnable,
    invalid_status,
    job_pods,
    pod_problems,
    status_changed,
)

NOW = datetime(2026, 11, 21, 20, 0, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)
CRD = Path(__file__).resolve().parents[2] / "crds" / "kuberl.io_rlexperiments.yaml"

BASE: dict[str, Any] = {
    "apiVersion": "kuberl.io/v1alpha1",
    "kind": "RLExperiment",
    "metadata": {"name": "exp", "namespace": "team-a", "generation": 1},
    "spec": {
        "model": {"id": "Qwen/Qwen2.5-0.5B-Instruct"},
        "dataset": {"id": "openai/gsm8k"},
        "rollout": {"replicas": 2, "accelerator": {"type": "nvidia", "count": 1}},
        "trainer": {"nodes": 1, "accelerator": {"type": "nvidia", "count": 2}},
        "training": {"totalSteps": 100},
        "failurePolicy": {"maxRestarts": 2},
    },
}


def make_experiment(status: dict | None = None, generation: int = 1, **spec: Any) -> RLExperiment:
    manifest = copy.deepcopy(BASE)
    manifest["metadata"]["generation"] = generation
    manifest["spec"].update(spec)
    if status is not None:
        manifest["status"] = status
    return RLExperiment.model_validate(manifest)


def with_status(exp: RLExperiment, status: dict) -> RLExperiment:
    """The experiment as the handlers see it after patching `status`."""
    return exp.model_copy(update={"status": RLExperimentStatus.model_validate(status)})


def children(exp: RLExperiment, bus_ready: int = 1, rollout_ready: int = 2, trainer_ready: int = 1, job_conditions: list | None = None) -> ObservedChildren:
    """Children as the API would return them, with the given readiness."""
    bus = build_bus_statefulset(exp)
    bus["status"] = {"replicas": bus["spec"]["replicas"], "readyReplicas": bus_ready}
    rollout = build_rollout_statefulset(exp)
    rollout["status"] = {"replicas": rollout["spec"]["replicas"], "readyReplicas": rollout_ready}
    job = build_trainer_job(exp)
    job["status"] = {"active": trainer_ready, "ready": trainer_ready, "conditions": job_conditions or []}
    return ObservedChildren(bus=bus, rollout=rollout, trainer=job)


PROGRESS = {
    "step": 12, "total_steps": 100, "epoch": 0, "policy_version": 12, "reward_mean": 0.5312,
    "samples_per_second": 41.5, "staleness_mean": 0.8, "staleness_max": 2, "dropped_stale": 3,
    "trainer_wait_fraction": 0.1, "groups_buffered": 4, "done": False, "failed": None,
    "checkpoint": {"step": 10, "policy_version": 10, "path": "checkpoints/step-00000010", "time": 1795000000.0},
    "time": 1795000100.0,
}  # fmt: skip


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def cond(status: dict, type_: str) -> tuple[str, str]:
    c = conditions(status)[type_]
    return c["status"], c["reason"]


class TestPhases:
    def test_an_experiment_without_children_is_pending_while_they_are_created(self) -> None:
        s = compute_status(make_experiment(), ObservedChildren(), None, NOW)
        assert s["phase"] == "Pending"
        assert cond(s, "Ready") == ("False", "Creating") and cond(s, "Progressing") == ("True", "Creating")

    def test_it_is_initializing_while_roles_come_up(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp, rollout_ready=0), None, NOW)
        assert s["phase"] == "Initializing"
        assert cond(s, "Ready") == ("False", "WaitingForRollout")
        assert "rollout 0/2" in conditions(s)["Ready"]["message"]

    def test_it_waits_for_the_bus_first(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp, bus_ready=0), None, NOW)
        assert s["phase"] == "Initializing" and cond(s, "Ready")[1] == "WaitingForBus"

    def test_it_runs_once_every_role_is_up(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), PROGRESS, NOW)
        assert s["phase"] == "Running"
        assert cond(s, "Ready") == ("True", "Training") and cond(s, "Degraded") == ("False", "AsExpected")
        assert s["startTime"] == "2026-11-21T20:00:00Z"

    def test_a_running_experiment_with_a_replica_coming_up_is_progressing_not_ready_and_not_degraded(self) -> None:
        # A scale-up or an engine loading its model is normal: Argo CD must not flip to Degraded.
        exp = make_experiment()
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        s = compute_status(running, children(exp, rollout_ready=1), PROGRESS, LATER)
        assert s["phase"] == "Running"
        assert cond(s, "Ready") == ("False", "ReplicasNotReady") and cond(s, "Progressing")[0] == "True"
        assert cond(s, "Degraded") == ("False", "AsExpected")
        assert s["rollout"] == {"desired": 2, "ready": 1, "readyText": "1/2"}
        assert s["startTime"] == "2026-11-21T20:00:00Z"  # kept from the first time it ran

    def test_a_complete_job_means_succeeded(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp, job_conditions=[{"type": "Complete", "status": "True"}]), PROGRESS, NOW)
        assert s["phase"] == "Succeeded"
        assert cond(s, "Complete") == ("True", "TrainingComplete") and cond(s, "Progressing")[0] == "False"
        assert s["completionTime"] == "2026-11-21T20:00:00Z"

    def test_the_trainer_reporting_done_means_succeeded(self) -> None:
        exp = make_experiment()
        assert compute_status(exp, children(exp), {**PROGRESS, "done": True}, NOW)["phase"] == "Succeeded"

    def test_succeeded_stays_succeeded_for_the_same_generation_once_pods_are_gone(self) -> None:
        exp = make_experiment()
        done = with_status(exp, compute_status(exp, children(exp, job_conditions=[{"type": "Complete", "status": "True"}]), PROGRESS, NOW))
        s = compute_status(done, ObservedChildren(), None, LATER)
        assert s["phase"] == "Succeeded" and s["completionTime"] == "2026-11-21T20:00:00Z"

    def test_a_failed_job_with_restarts_left_is_a_restart_not_a_failure(self) -> None:
        exp = make_experiment()
        failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        s = compute_status(running, children(exp, trainer_ready=0, job_conditions=failed), PROGRESS, LATER)
        assert s["phase"] == "Running"
        assert cond(s, "Degraded") == ("True", "TrainerRestarting") and cond(s, "Failed")[0] == "False"

    def test_a_failed_job_after_max_restarts_fails_the_experiment(self) -> None:
        exp = make_experiment()
        failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]
        obs = children(exp, trainer_ready=0, job_conditions=failed)
        s = compute_status(exp, ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=obs.trainer, trainer_restarts=2), PROGRESS, NOW)
        assert s["phase"] == "Failed"
        assert cond(s, "Failed") == ("True", "MaxRestartsExceeded")
        assert "maxRestarts=2" in conditions(s)["Failed"]["message"] and s["restarts"] == 2

    def test_restarts_default_to_the_count_already_in_status(self) -> None:
        exp = make_experiment(status={"restarts": 2})
        failed = [{"type": "Failed", "status": "True"}]
        s = compute_status(exp, children(exp, trainer_ready=0, job_conditions=failed), None, NOW)
        assert s["phase"] == "Failed" and s["restarts"] == 2

    def test_a_reported_failure_with_restarts_left_is_a_restart_not_the_end(self) -> None:
        """A trainer that reports a failure exits 1 (retryable, contracts.md): the handlers re-create its Job from the last
        checkpoint under failurePolicy, so the phase must not turn Failed (a terminal phase stays terminal)."""
        exp = make_experiment(status={"restarts": 1, "startTime": "2026-11-28T00:00:00Z"})
        s = compute_status(exp, children(exp), {**PROGRESS, "failed": "NatsError: nats: timeout"}, NOW)
        assert s["phase"] == "Running" and cond(s, "Failed")[0] != "True"
        assert cond(s, "Degraded") == ("True", "TrainerRestarting")
        assert conditions(s)["Degraded"]["message"] == "the trainer reported a failure (NatsError: nats: timeout)"
        failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]
        s = compute_status(exp, children(exp, trainer_ready=0, job_conditions=failed), {**PROGRESS, "failed": "NatsError: nats: timeout"}, NOW)
        assert s["phase"] == "Running" and cond(s, "Degraded") == ("True", "TrainerRestarting")
        assert conditions(s)["Degraded"]["message"] == "trainer failed (NatsError: nats: timeout); restart 2 of 2 from the last checkpoint"

    def test_a_reported_failure_fails_the_experiment_once_the_restarts_are_used_up(self) -> None:
        exp = make_experiment(status={"restarts": 2})  # failurePolicy.maxRestarts 2: all used
        failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]
        s = compute_status(exp, children(exp, trainer_ready=0, job_conditions=failed), {**PROGRESS, "failed": "NatsError: nats: timeout"}, NOW)
        assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "MaxRestartsExceeded")
        assert conditions(s)["Failed"]["message"].endswith("after 2 of failurePolicy.maxRestarts=2 restarts; the trainer reported: NatsError: nats: timeout")
        none = make_experiment(failurePolicy={"maxRestarts": 0})
        s = compute_status(none, children(none, trainer_ready=0, job_conditions=failed), {**PROGRESS, "failed": "x"}, NOW)
        assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "MaxRestartsExceeded")

    def test_a_failure_reported_after_done_fails_the_experiment(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), {**PROGRESS, "done": True, "failed": "OSError: final checkpoint"}, NOW)
        assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "TrainerFailed")

    def test_suspended_while_pods_stop_then_suspended(self) -> None:
        exp = make_experiment(suspend=True)
        stopping = compute_status(exp, children(exp, bus_ready=1, rollout_ready=1, trainer_ready=0), None, NOW)
        assert stopping["phase"] == "Suspended" and cond(stopping, "Suspended") == ("True", "Suspending")
        stopped = compute_status(exp, children(exp, bus_ready=0, rollout_ready=0, trainer_ready=0), None, NOW)
        assert cond(stopped, "Suspended") == ("True", "Suspended") and cond(stopped, "Ready")[0] == "False"
        assert stopped["rollout"]["desired"] == 0 and stopped["trainer"]["desired"] == 0

    def test_a_builder_error_is_a_validation_failure(self) -> None:
        s = compute_status(make_experiment(), ObservedChildren(validation_errors=("spec.bus.maxPayload: '100Mi' is above NATS's 64Mi limit",)), None, NOW)
        assert s["phase"] == "Failed" and cond(s, "Validated") == ("False", "ValidationFailed")
        assert "spec.bus.maxPayload" in conditions(s)["Validated"]["message"]


class TestConditions:
    def test_every_condition_carries_the_generation_it_was_computed_for(self) -> None:
        s = compute_status(make_experiment(generation=7), ObservedChildren(), None, NOW, applied=Applied(7))
        assert s["observedGeneration"] == 7
        assert {c["observedGeneration"] for c in s["conditions"]} == {7}
        assert set(conditions(s)) == {"Ready", "Progressing", "Degraded", "Suspended", "Complete", "Failed", "Validated", "Reconciled"}
        assert cond(s, "Reconciled") == ("True", "Applied")

    def test_observed_generation_moves_only_after_a_successful_apply(self) -> None:
        # A monitor tick (nothing applied) keeps the old observedGeneration; a failed apply too, and
        # says why in Reconciled=False/ApplyFailed naming the field (Argo CD: spec change not reconciled).
        exp = make_experiment(status={"phase": "Running", "observedGeneration": 3}, generation=4)
        tick = compute_status(exp, children(exp), PROGRESS, NOW)
        assert tick["observedGeneration"] == 3 and "Reconciled" not in conditions(tick)
        msg = "StatefulSet/exp-bus: spec.volumeClaimTemplates cannot change after creation"
        failed = compute_status(exp, children(exp), PROGRESS, NOW, applied=Applied(4, (msg,)))
        assert failed["observedGeneration"] == 3
        assert cond(failed, "Reconciled") == ("False", "ApplyFailed") and msg in conditions(failed)["Reconciled"]["message"]
        later = compute_status(with_status(exp, failed), children(exp), PROGRESS, LATER)
        assert cond(later, "Reconciled") == ("False", "ApplyFailed"), "a tick keeps the apply's verdict"
        ok = compute_status(with_status(exp, failed), children(exp), PROGRESS, LATER, applied=Applied(4))
        assert ok["observedGeneration"] == 4 and cond(ok, "Reconciled") == ("True", "Applied")

    def test_last_transition_time_holds_while_the_status_holds(self) -> None:
        exp = make_experiment()
        first = compute_status(exp, children(exp, rollout_ready=0), None, NOW)
        # Reason changes (WaitingForRollout -> WaitingForBus) but Ready stays False: the time stays.
        second = compute_status(with_status(exp, first), children(exp, bus_ready=0, rollout_ready=0), None, LATER)
        assert conditions(second)["Ready"]["lastTransitionTime"] == "2026-11-21T20:00:00Z"
        third = compute_status(with_status(exp, second), children(exp), PROGRESS, LATER)
        assert conditions(third)["Ready"]["status"] == "True"
        assert conditions(third)["Ready"]["lastTransitionTime"] == "2026-11-21T20:05:00Z"

    def test_the_status_fits_the_crd_status_schema(self) -> None:
        crd = yaml.safe_load(CRD.read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        exp = make_experiment()
        for s in (
            compute_status(exp, ObservedChildren(), None, NOW),
            compute_status(exp, children(exp), PROGRESS, NOW),
            compute_status(make_experiment(suspend=True), children(exp, 0, 0, 0), None, NOW),
            invalid_status(None, 3, ["spec.rollout.replicas: must be >= 0"], NOW),
        ):
            jsonschema.validate(s, schema)


class TestProgressAndScale:
    def test_progress_fields_come_from_the_bus(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), PROGRESS, NOW)
        p = s["progress"]
        assert p["steps"] == "12/100" and p["rewardText"] == "0.53" and p["policyVersion"] == 12
        assert p["stalenessMax"] == 2 and p["droppedStale"] == 3 and p["samplesPerSecond"] == 41.5
        assert p["updatedAt"].endswith("Z")
        assert s["lastCheckpoint"] == {"step": 10, "policyVersion": 10, "path": "checkpoints/step-00000010",
                                       "time": datetime.fromtimestamp(1795000000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}

    def test_total_steps_fall_back_to_the_spec(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), {"step": 3}, NOW)
        assert s["progress"]["steps"] == "3/100"

    def test_an_unreadable_bus_keeps_the_last_progress(self) -> None:
        exp = make_experiment()
        first = compute_status(exp, children(exp), PROGRESS, NOW)
        again = compute_status(with_status(exp, first), children(exp), None, LATER)
        assert again["progress"] == first["progress"] and again["lastCheckpoint"] == first["lastCheckpoint"]

    def test_garbage_from_the_bus_does_not_crash_the_status(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), {"step": "x", "reward_mean": "nan?", "samples_per_second": -3, "checkpoint": "no", "time": "soon"}, NOW)
        assert s["progress"]["step"] == 0 and "rewardText" not in s["progress"] and "samplesPerSecond" not in s["progress"]

    def test_replicas_and_selector_serve_the_scale_subresource(self) -> None:
        exp = make_experiment()
        s = compute_status(exp, children(exp), PROGRESS, NOW)
        assert s["replicas"] == 2
        assert s["selector"] == "kuberl.io/experiment=exp,kuberl.io/role=rollout"


class TestUnrunnable:
    def test_a_missing_hub_token_secret_names_the_field_and_the_secret(self) -> None:
        exp = make_experiment(model={"id": "meta/llama", "hubTokenSecret": {"name": "hf"}})
        problems = explain_unrunnable(exp, ObservedChildren(missing_secrets=frozenset({"hf"})))
        assert [p.reason for p in problems] == [Reason.SECRET_NOT_FOUND]
        assert "spec.model.hubTokenSecret" in problems[0].message and "'hf'" in problems[0].message
        s = compute_status(exp, ObservedChildren(missing_secrets=frozenset({"hf"})), None, NOW)
        assert s["phase"] == "Pending" and cond(s, "Ready") == ("False", "SecretNotFound") and cond(s, "Progressing")[0] == "False"

    def test_a_secret_without_the_key_is_explained(self) -> None:
        exp = make_experiment(bus={"external": {"url": "nats://n:4222", "credentialsSecret": {"name": "creds", "key": "tok"}}})
        problems = explain_unrunnable(exp, ObservedChildren(missing_secret_keys=frozenset({("creds", "tok")})))
        assert problems[0].reason == Reason.SECRET_NOT_FOUND
        assert "spec.bus.external.credentialsSecret" in problems[0].message and "no key 'tok'" in problems[0].message

    def test_a_missing_existing_claim_is_explained(self) -> None:
        exp = make_experiment(checkpoint={"existingClaim": "ckpt"})
        problems = explain_unrunnable(exp, ObservedChildren(missing_claims=frozenset({"ckpt"})))
        assert problems[0].reason == Reason.CLAIM_NOT_FOUND and "spec.checkpoint.existingClaim" in problems[0].message

    def test_accelerator_capacity_is_advisory_and_reads_node_selector_and_taints(self) -> None:
        # B1: a scale-from-zero pool has no GPU node until a pod is pending: never a blocker.
        from kuberl.operator.capacity import capacity_advisories

        exp = make_experiment(trainer={"nodes": 1, "accelerator": {"type": "nvidia", "count": 8}})
        pods = {"rollout": build_rollout_statefulset(exp)["spec"]["template"]["spec"], "trainer": build_trainer_job(exp)["spec"]["template"]["spec"]}

        def node(gpus: int, labels: dict | None = None, taints: list | None = None) -> dict:
            return {"metadata": {"name": "n", "labels": labels or {}}, "spec": {"taints": taints or []},
                    "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}

        notes = capacity_advisories(exp, pods, [])
        assert [n.reason for n in notes] == [Reason.INSUFFICIENT_ACCELERATORS] * 2
        assert "spec.trainer.accelerator.count" in notes[1].message and "8 nvidia.com/gpu" in notes[1].message
        assert "created anyway" in notes[1].message
        assert capacity_advisories(exp, pods, [node(8)]) == []
        taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
        # GKE's GPU taint: ExtendedResourceToleration gives every pod that requests nvidia.com/gpu its toleration.
        assert capacity_advisories(exp, pods, [node(8, taints=taint)]) == [], "the taint of the requested resource is tolerated"
        other = [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}]
        assert len(capacity_advisories(exp, pods, [node(8, taints=other)])) == 2, "an untolerated taint keeps the pods off"
        tolerant = make_experiment(rollout={"replicas": 2, "accelerator": {"type": "nvidia", "count": 1},
                                            "tolerations": [{"key": "dedicated", "operator": "Exists"}]},
                                   trainer={"nodes": 1, "accelerator": {"type": "nvidia", "count": 8}, "nodeSelector": {"pool": "gpu"}})
        tpods = {"rollout": build_rollout_statefulset(tolerant)["spec"]["template"]["spec"], "trainer": build_trainer_job(tolerant)["spec"]["template"]["spec"]}
        notes = capacity_advisories(tolerant, tpods, [node(8, taints=taint + other)])
        assert [n.message.split(":")[0] for n in notes] == ["spec.trainer.accelerator.count"], "the trainer's nodeSelector does not match"
        # Advisory: explain_unrunnable (which blocks nothing but sets Pending) does not list it, and
        # the status stays on its normal path with the note in the message.
        obs = ObservedChildren(advisories=tuple(capacity_advisories(exp, pods, [])))
        assert explain_unrunnable(exp, obs) == []
        s = compute_status(exp, ObservedChildren(**{**children(exp, rollout_ready=0).__dict__, "advisories": obs.advisories}), None, NOW)
        assert s["phase"] == "Initializing" and cond(s, "Progressing")[0] == "True"
        assert "scheduler or a cluster autoscaler" in conditions(s)["Ready"]["message"]

    def test_image_pull_errors_are_read_from_pods(self) -> None:
        pod = {
            "metadata": {"name": "exp-rollout-0"},
            "spec": {"containers": [{"name": "engine", "image": "ghcr.io/kuberl/runtime-sglang:nope"}]},
            "status": {"containerStatuses": [{"name": "engine", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]},
        }
        problems = pod_problems(pod)
        assert problems == [PodProblem("exp-rollout-0", "ImagePullBackOff", "Back-off pulling image", "engine", "ghcr.io/kuberl/runtime-sglang:nope")]
        explained = explain_unrunnable(make_experiment(), ObservedChildren(pod_problems=tuple(problems)))
        assert explained[0].reason == Reason.IMAGE_PULL_FAILED and "runtime-sglang:nope" in explained[0].message

    def test_unschedulable_pods_are_read_from_pods(self) -> None:
        pod = {"metadata": {"name": "exp-trainer-0-abc"}, "status": {"conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
        problems = pod_problems(pod)
        assert problems[0].reason == "Unschedulable"
        assert explain_unrunnable(make_experiment(), ObservedChildren(pod_problems=tuple(problems)))[0].reason == Reason.UNSCHEDULABLE

    def test_unschedulable_pods_are_progress_with_the_capacity_note_not_degraded(self) -> None:
        """A scale-from-zero pool gets its node only for pending pods: Progressing stays True, Degraded False, and the
        message carries the scheduler's words and the capacity note (seen on a real scheduler: it used to say
        Progressing=False, and a running experiment scaling up went Degraded)."""
        from kuberl.operator.capacity import capacity_advisories

        exp = make_experiment(trainer={"nodes": 1, "accelerator": {"type": "nvidia", "count": 8}})
        pods = {"rollout": build_rollout_statefulset(exp)["spec"]["template"]["spec"], "trainer": build_trainer_job(exp)["spec"]["template"]["spec"]}
        stuck = PodProblem("exp-trainer-0-abc", "Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
        obs = ObservedChildren(**{**children(exp, rollout_ready=0).__dict__, "pod_problems": (stuck,),
                                  "advisories": tuple(capacity_advisories(exp, pods, []))})
        s = compute_status(exp, obs, None, NOW)
        assert s["phase"] == "Pending" and cond(s, "Ready") == ("False", "Unschedulable") and cond(s, "Progressing")[0] == "True"
        assert "Insufficient nvidia.com/gpu" in conditions(s)["Ready"]["message"] and "cluster autoscaler" in conditions(s)["Ready"]["message"]
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        s = compute_status(running, obs, PROGRESS, NOW)
        assert s["phase"] == "Running" and cond(s, "Degraded")[0] == "False"
        # A problem only the user can fix still stops progress.
        pull = PodProblem("exp-rollout-0", "ImagePullBackOff", "Back-off", "engine", "nope:1")
        s = compute_status(exp, ObservedChildren(**{**obs.__dict__, "pod_problems": (stuck, pull)}), None, NOW)
        assert cond(s, "Ready") == ("False", "ImagePullFailed") and cond(s, "Progressing")[0] == "False"

    def test_a_crash_loop_degrades_a_running_experiment(self) -> None:
        exp = make_experiment()
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        obs = children(exp)
        crash = PodProblem("exp-rollout-1", "CrashLoopBackOff", "back-off 5m0s", "rollout-agent")
        s = compute_status(running, ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=obs.trainer, pod_problems=(crash,)), PROGRESS, LATER)
        assert s["phase"] == "Running" and cond(s, "Degraded") == ("True", "CrashLoopBackOff") and cond(s, "Ready")[0] == "False"

    def test_handler_blockers_pass_through_from_objects(self) -> None:
        obs = ObservedChildren.from_objects(pod_problems=[("p", "ErrImagePull", "not found")], blockers=[("SecretNotFound", "spec.model.hubTokenSecret: gone")])
        reasons = [p.reason for p in explain_unrunnable(make_experiment(), obs)]
        assert reasons == [Reason.SECRET_NOT_FOUND, Reason.IMAGE_PULL_FAILED]


MEGATRON = "trainer.backend 'megatron' is not implemented by this trainer yet; use trainer.backend fsdp"
POLICY_FAILED = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                 "message": "Container trainer for pod team-a/exp-trainer-0-x7k2p failed with exit code 2 matching FailJob rule at index 0"}


def trainer_job(exp: RLExperiment, conditions: list[dict], uid: str = "job-uid-1") -> dict:
    """The trainer Job as read: the API server's uid and controller-uid selector, and a status."""
    job = build_trainer_job(exp)
    job["metadata"]["uid"] = uid
    job["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    job["status"] = {"active": 0, "failed": 1, "conditions": conditions}
    return job


def terminated_pod(name: str, labels: dict, container: str, exit_code: int, message: str = "", *, last: bool = False) -> dict:
    """A pod whose container terminated (`last`: and was restarted, now waiting in CrashLoopBackOff)."""
    terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
    cs = {"name": container, "ready": False, "restartCount": 3 if last else 0}
    if last:
        cs |= {"state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}}, "lastState": {"terminated": terminated}}
    else:
        cs |= {"state": {"terminated": terminated}}
    return {"metadata": {"name": name, "labels": {"kuberl.io/experiment": "exp", **labels}}, "status": {"containerStatuses": [cs]}}


def trainer_pod(exit_code: int, message: str = "", uid: str = "job-uid-1") -> dict:
    labels = {"kuberl.io/role": "trainer", "batch.kubernetes.io/job-name": "exp-trainer", "batch.kubernetes.io/controller-uid": uid}
    return terminated_pod("exp-trainer-0-x7k2p", labels, "trainer", exit_code, message)


class TestConfigurationErrors:
    """A role that exits 2 (contracts.md) fails the experiment at once, with its termination message."""

    def observed(self, exp: RLExperiment, job: dict, pods: list[dict], restarts: int = 0) -> ObservedChildren:
        obs = children(exp, trainer_ready=0)
        return ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=job, trainer_restarts=restarts,
                                configuration_error=configuration_error(job, pods))

    def test_a_job_failed_by_its_pod_failure_policy_fails_the_experiment_with_the_pods_message(self) -> None:
        exp = make_experiment()  # failurePolicy.maxRestarts 2: restarts are left, and none is wanted
        job = trainer_job(exp, [POLICY_FAILED])
        obs = self.observed(exp, job, [trainer_pod(2, MEGATRON)])
        assert obs.configuration_error == ConfigurationFailure("trainer", MEGATRON, "exp-trainer-0-x7k2p", "trainer")
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        s = compute_status(running, obs, PROGRESS, LATER)
        assert s["phase"] == "Failed" and s["restarts"] == 0
        assert cond(s, "Failed") == ("True", "ConfigurationError") and cond(s, "Ready") == ("False", "ConfigurationError")
        message = conditions(s)["Failed"]["message"]
        assert MEGATRON in message and "exp-trainer-0-x7k2p" in message and "exit code 2" in message
        assert conditions(s)["Ready"]["message"] == message

    def test_a_failed_trainer_that_exited_1_is_restarted_as_before(self) -> None:
        exp = make_experiment()
        job = trainer_job(exp, [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}])
        obs = self.observed(exp, job, [trainer_pod(1, "Traceback (most recent call last): ... CUDA out of memory")])
        assert obs.configuration_error is None
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        s = compute_status(running, obs, PROGRESS, LATER)
        assert s["phase"] == "Running" and cond(s, "Degraded") == ("True", "TrainerRestarting") and cond(s, "Failed")[0] == "False"

    def test_exit_code_2_counts_even_without_the_policy_and_the_job_message_serves_when_the_pod_is_gone(self) -> None:
        exp = make_experiment()
        backoff = trainer_job(exp, [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}])
        assert configuration_error(backoff, [trainer_pod(2, MEGATRON)]).message == MEGATRON
        gone = configuration_error(trainer_job(exp, [POLICY_FAILED]), [])
        assert gone == ConfigurationFailure("trainer", POLICY_FAILED["message"])
        assert "exit code 2" in gone.describe()

    def test_pods_of_an_earlier_trainer_job_do_not_count(self) -> None:
        exp = make_experiment()
        job = trainer_job(exp, [], uid="job-uid-2")
        old = trainer_pod(2, MEGATRON, uid="job-uid-1")
        assert job_pods(job, [old]) == [] and configuration_error(job, [old]) is None
        # Without a selector (as some API fakes return Jobs) the job-name label and the uid decide.
        del job["spec"]["selector"]
        assert job_pods(job, [old]) == [] and job_pods(job, [trainer_pod(2, uid="job-uid-2")]) != []

    def test_a_rollout_container_whose_last_run_exited_2_fails_the_experiment_instead_of_crash_looping(self) -> None:
        exp = make_experiment()
        reason = "model.path: '/models/models/qwen' is not a folder"
        pod = terminated_pod("exp-rollout-1", {"kuberl.io/role": "rollout"}, "engine", 2, reason, last=True)
        obs = children(exp)
        failure = configuration_error(obs.trainer, [pod])
        assert failure == ConfigurationFailure("rollout", reason, "exp-rollout-1", "engine")
        crash = PodProblem("exp-rollout-1", "CrashLoopBackOff", "back-off 5m0s", "engine")
        s = compute_status(exp, ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=obs.trainer, pod_problems=(crash,),
                                                 configuration_error=failure), PROGRESS, NOW)
        assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "ConfigurationError") and reason in conditions(s)["Failed"]["message"]
        # Exit 1 in a crash loop stays a Degraded crash loop (the kubelet keeps retrying).
        assert configuration_error(obs.trainer, [terminated_pod("exp-rollout-1", {"kuberl.io/role": "rollout"}, "engine", 1, last=True)]) is None

    def test_the_failure_and_its_reason_stay_once_the_pods_are_gone(self) -> None:
        exp = make_experiment()
        pod = terminated_pod("exp-rollout-0", {"kuberl.io/role": "rollout"}, "rollout-agent", 2, "dataset.path: '/data/x.jsonl' does not exist")
        obs = children(exp)
        failed = compute_status(exp, ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=obs.trainer,
                                                      configuration_error=configuration_error(obs.trainer, [pod])), PROGRESS, NOW)
        later = compute_status(with_status(exp, failed), children(exp, rollout_ready=0), None, LATER)
        assert later["phase"] == "Failed" and cond(later, "Failed") == ("True", "ConfigurationError")
        assert conditions(later)["Failed"]["message"] == conditions(failed)["Failed"]["message"]

    def test_the_status_of_a_configuration_error_fits_the_crd_status_schema(self) -> None:
        crd = yaml.safe_load(CRD.read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        exp = make_experiment()
        s = compute_status(exp, self.observed(exp, trainer_job(exp, [POLICY_FAILED]), [trainer_pod(2, MEGATRON)]), PROGRESS, NOW)
        jsonschema.validate(s, schema)


class TestStatusChanged:
    def test_a_recomputed_status_with_nothing_new_is_no_change(self) -> None:
        exp = make_experiment()
        first = compute_status(exp, children(exp), PROGRESS, NOW)
        assert not status_changed(first, compute_status(with_status(exp, first), children(exp), PROGRESS, LATER))

    def test_only_last_transition_time_differing_is_no_change(self) -> None:
        exp = make_experiment()
        a = compute_status(exp, children(exp), PROGRESS, NOW)
        b = copy.deepcopy(a)
        for c in b["conditions"]:
            c["lastTransitionTime"] = "2030-01-01T00:00:00Z"
        assert a != b and not status_changed(a, b)
        b["conditions"][0]["message"] = "something else"
        assert status_changed(a, b)

    def test_a_phase_change_is_a_change(self) -> None:
        exp = make_experiment()
        a = compute_status(exp, children(exp, rollout_ready=0), None, NOW)
        assert status_changed(a, compute_status(with_status(exp, a), children(exp), PROGRESS, NOW))

    def test_fields_of_other_writers_are_ignored(self) -> None:
        exp = make_experiment()
        new = compute_status(exp, children(exp), PROGRESS, NOW)
        assert not status_changed({**new, "kopf": {"progress": {}}}, new)
        assert status_changed(None, new)


class TestInvalidSpec:
    def test_a_fixed_spec_leaves_validation_failed_behind_and_starts(self) -> None:
        # B3: the Failed phase an invalid spec left must not read as "finished" once the spec parses.
        bad = invalid_status({}, 2, ["spec.trainer.accelerator.count: does not split"], NOW)
        exp = make_experiment(status=bad, generation=3)
        s = compute_status(exp, ObservedChildren(), None, LATER)
        assert s["phase"] == "Pending" and cond(s, "Ready") == ("False", "Creating")
        assert cond(s, "Failed")[0] == "False" and cond(s, "Validated") == ("True", "SpecValid")
        same_generation = make_experiment(status=bad, generation=2)  # e.g. an operator restart read it
        assert compute_status(same_generation, ObservedChildren(), None, LATER)["phase"] == "Pending"

    def test_rollout_left_at_zero_while_the_spec_wants_engines_is_never_ready(self) -> None:
        # B3: reverting a scale must restore the engines; until it does, the status must not read Ready.
        exp = make_experiment()
        running = with_status(exp, compute_status(exp, children(exp), PROGRESS, NOW))
        obs = children(exp)
        stuck = {**obs.rollout, "spec": {**obs.rollout["spec"], "replicas": 0}, "status": {"replicas": 0, "readyReplicas": 0}}
        s = compute_status(running, ObservedChildren(bus=obs.bus, rollout=stuck, trainer=obs.trainer), PROGRESS, LATER)
        assert cond(s, "Ready")[0] == "False" and "asks for 2" in conditions(s)["Ready"]["message"]

    def test_an_invalid_manifest_fails_with_the_errors_as_the_message(self) -> None:
        s = invalid_status({"phase": "Running"}, 4, ["spec.rollout.replicas: must be >= 0 (got -1)"], NOW)
        assert s["phase"] == "Failed" and s["observedGeneration"] == 4
        assert cond(s, "Validated") == ("False", "ValidationFailed")
        assert "spec.rollout.replicas" in conditions(s)["Failed"]["message"]


@pytest.mark.parametrize("progress", [None, PROGRESS])
def test_compute_status_is_pure(progress: dict | None) -> None:
    exp = make_experiment()
    obs = children(exp)
    assert compute_status(exp, obs, progress, NOW) == compute_status(exp, obs, progress, NOW)


class TestPendingVolumes:
    """observed.pending_volume_problem: why a PVC of ours stays Pending, only when nothing will ever provision it."""

    DEFAULT = {"standard": {"metadata": {"name": "standard", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}}}}
    PLAIN = {"fast": {"metadata": {"name": "fast"}}}

    @staticmethod
    def pvc(phase: str, cls: str | None) -> dict:
        return {"metadata": {"name": "x-checkpoints"}, "spec": {} if cls is None else {"storageClassName": cls}, "status": {"phase": phase}}

    def test_a_missing_class_is_named_with_the_field(self) -> None:
        from kuberl.operator.status import pending_volume_problem

        msg = pending_volume_problem("spec.checkpoint.storageClassName", self.pvc("Pending", "gp3"), self.DEFAULT)
        assert msg == ("spec.checkpoint.storageClassName: PersistentVolumeClaim 'x-checkpoints' is Pending: StorageClass 'gp3' does "
                       "not exist (`kubectl get storageclass` lists the cluster's)")

    def test_no_class_named_and_no_default_one_says_to_set_the_field(self) -> None:
        from kuberl.operator.status import pending_volume_problem

        msg = pending_volume_problem("spec.bus.embedded.storageClassName", self.pvc("Pending", None), self.PLAIN)
        assert "names no StorageClass and the cluster has no default one; set spec.bus.embedded.storageClassName" in msg

    def test_bound_provisioning_or_hand_bound_volumes_are_no_problem(self) -> None:
        from kuberl.operator.status import pending_volume_problem

        assert pending_volume_problem("f", self.pvc("Bound", "gp3"), {}) is None
        assert pending_volume_problem("f", self.pvc("Pending", "fast"), self.PLAIN) is None  # provisioning or WaitForFirstConsumer
        assert pending_volume_problem("f", self.pvc("Pending", None), self.DEFAULT) is None  # the default class takes it
        assert pending_volume_problem("f", self.pvc("Pending", ""), {}) is None  # bound by hand to a pre-made volume
        assert pending_volume_problem("f", None, {}) is None
