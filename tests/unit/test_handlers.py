"""The pure helpers of the kopf handlers and their lifecycle logic, and the operator's settings."""

from __future__ import annotations

import base64
import datetime as dt

import kopf
import pytest
from pydantic import ValidationError

from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator import status as st
from kuberl.operator.kube import path_for
from kuberl.operator.main import configure_settings
from kuberl.operator.progress import kv_bucket

T0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def body(name: str = "demo", **spec_overrides: object) -> dict:
    spec = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, **spec_overrides}
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
            "metadata": {"name": name, "namespace": "team-a", "uid": "u1", "generation": 3, "resourceVersion": "9",
                         "annotations": {"kuberl.io/last-handled-configuration": "{}"}},
            "spec": spec, "status": {"phase": "Running"}}


class TestParsingTheBody:
    def test_a_valid_body_becomes_the_model_with_its_namespace_and_last_status(self) -> None:
        exp = handlers.parse_experiment(body())
        assert (exp.name, exp.namespace, exp.status.phase) == ("demo", "team-a", "Running")

    def test_a_malformed_status_is_ignored_rather_than_blocking_the_experiment(self) -> None:
        b = body()
        b["status"] = {"phase": "Sleeping", "kopf": {"junk": 1}}
        assert handlers.parse_experiment(b).status is None

    def test_a_name_too_long_for_child_names_names_metadata_name_in_the_message(self) -> None:
        with pytest.raises(ValidationError) as info:
            handlers.parse_experiment(body("x" * 60))
        message = "; ".join(handlers.describe_validation_error(info.value))
        assert "metadata.name" in message and "52" in message

    def test_a_bad_spec_value_is_reported_with_its_path_and_value(self) -> None:
        with pytest.raises(ValidationError) as info:
            handlers.parse_experiment(body(rollout={"replicas": -1}))
        message = "; ".join(handlers.describe_validation_error(info.value))
        assert "spec.rollout.replicas" in message and "-1" in message

    def test_the_generation_reaches_the_model_for_observed_generation(self) -> None:
        exp = handlers.parse_experiment(body())
        assert exp.metadata.model_extra["generation"] == 3


class TestLifecycleRules:
    @pytest.mark.parametrize(("restarts", "seconds_since_failure", "due"), [
        (0, 29, False), (0, 30, True), (1, 59, False), (1, 60, True), (2, 119, False), (2, 120, True)])
    def test_restarts_wait_a_doubling_backoff(self, restarts: int, seconds_since_failure: int, due: bool) -> None:
        failed_at = T0 - dt.timedelta(seconds=seconds_since_failure)
        assert h.restart_due(restarts, 30, failed_at, T0) is due

    def test_a_checkpoint_counts_only_when_written_after_the_request(self) -> None:
        assert not h.checkpoint_answered(None, 100.0)
        assert not h.checkpoint_answered({"checkpoint": None}, 100.0)
        assert not h.checkpoint_answered({"checkpoint": {"time": 99.0}}, 100.0)
        assert h.checkpoint_answered({"checkpoint": {"time": 100.5}}, 100.0)

    def test_ttl_expires_only_after_completion_plus_ttl(self) -> None:
        assert not h.ttl_expired(None, "2026-01-01T11:00:00Z", T0)
        assert not h.ttl_expired(60, None, T0)
        assert not h.ttl_expired(60, "2026-01-01T11:59:30Z", T0)
        assert h.ttl_expired(60, "2026-01-01T11:59:00Z", T0)

    def test_phase_changes_give_one_event_warning_only_for_failed(self) -> None:
        assert h.phase_event("Running", "Running") is None
        assert h.phase_event("Initializing", "Running") == ("Normal", "PhaseRunning")
        assert h.phase_event("Running", "Failed") == ("Warning", "PhaseFailed")

    def test_the_running_copy_only_clears_suspend(self) -> None:
        exp = handlers.parse_experiment(body(suspend=True))
        running = h.running_copy(exp)
        assert running.spec.suspend is False and exp.spec.suspend is True
        assert running.spec.model_dump(exclude={"suspend"}) == exp.spec.model_dump(exclude={"suspend"})

    def test_a_suspend_counts_as_applied_once_the_live_job_is_suspended_or_memo_says_so(self) -> None:
        exp = handlers.parse_experiment(body(suspend=True))
        assert not h.suspend_applied(exp, {"spec": {"suspend": False}}, {})
        assert h.suspend_applied(exp, {"spec": {"suspend": True}}, {})
        assert h.suspend_applied(exp, None, {"suspend_applied": True})

    def test_a_job_condition_is_found_only_when_true(self) -> None:
        job = {"status": {"conditions": [{"type": "Failed", "status": "False"}, {"type": "Complete", "status": "True"}]}}
        assert h.job_condition(job, "Complete")["type"] == "Complete"
        assert h.job_condition(job, "Failed") is None
        assert h.job_condition(None, "Complete") is None


def failed_job(reason: str, at: dt.datetime = T0 - dt.timedelta(seconds=31)) -> dict:
    return {"metadata": {"name": "demo-trainer", "uid": "j1"}, "spec": {},
            "status": {"conditions": [{"type": "Failed", "status": "True", "reason": reason, "lastTransitionTime": h.rfc3339(at)}]}}


def trainer_pod(exit_code: int, message: str) -> dict:
    return {"metadata": {"name": "demo-trainer-0-abcde",
                         "labels": {"batch.kubernetes.io/job-name": "demo-trainer", "batch.kubernetes.io/controller-uid": "j1"}},
            "status": {"containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code, "message": message}}}]}}


class TestFailurePolicyDecisions:
    """restart_trainer: the failure policy re-creates a failed trainer Job, except after exit code 2."""

    POLICY = handlers.parse_experiment(body(failurePolicy={"maxRestarts": 3, "backoffSeconds": 30})).spec.failure_policy

    def observed(self, reason: str, exit_code: int, restarts: int = 0) -> st.ObservedChildren:
        job = failed_job(reason)
        return st.ObservedChildren(trainer=job, trainer_restarts=restarts,
                                   configuration_error=st.configuration_error(job, [trainer_pod(exit_code, "trainer.backend 'megatron' ...")]))

    def test_a_trainer_that_exited_1_is_restarted_once_its_backoff_passed(self) -> None:
        assert h.restart_trainer(self.observed("BackoffLimitExceeded", 1), self.POLICY, T0)
        assert not h.restart_trainer(self.observed("BackoffLimitExceeded", 1), self.POLICY, T0 - dt.timedelta(seconds=2))
        assert not h.restart_trainer(self.observed("BackoffLimitExceeded", 1, restarts=3), self.POLICY, T0)

    def test_a_job_failed_by_the_pod_failure_policy_on_exit_code_2_is_never_restarted(self) -> None:
        observed = self.observed("PodFailurePolicy", 2)
        assert observed.configuration_error is not None and observed.configuration_error.message.startswith("trainer.backend")
        assert not h.restart_trainer(observed, self.POLICY, T0 + dt.timedelta(days=1))
        # Exit code 2 is enough (a Job rendered before the policy existed fails with BackoffLimitExceeded).
        assert not h.restart_trainer(self.observed("BackoffLimitExceeded", 2), self.POLICY, T0)

    def test_the_configuration_error_event_is_posted_once_also_across_operator_restarts(self) -> None:
        memo: dict = {}
        assert h.configuration_error_event_due({"phase": "Running"}, "the trainer stopped: x", memo)
        memo["configuration_error_reported"] = "the trainer stopped: x"
        assert not h.configuration_error_event_due({"phase": "Running"}, "the trainer stopped: x", memo)
        posted = {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": "ConfigurationError", "message": "the trainer stopped: x"}]}
        assert not h.configuration_error_event_due(posted, "the trainer stopped: x", {})
        assert h.configuration_error_event_due(posted, "the rollout stopped: y", {})

    def test_only_a_trainer_job_that_still_runs_is_stopped(self) -> None:
        assert h.trainer_running({"spec": {}, "status": {"active": 1}})
        assert not h.trainer_running({"spec": {"suspend": True}})
        assert not h.trainer_running(failed_job("PodFailurePolicy"))
        assert not h.trainer_running(None)
        exp = handlers.parse_experiment(body())
        assert h.stopped_copy(exp).spec.suspend is True and exp.spec.suspend is False


class TestStatusPatchesAndSecrets:
    def test_keys_that_disappear_from_status_are_nulled_in_the_merge_patch(self) -> None:
        patch = h.merge_patch_for({"phase": "Running", "lastCheckpoint": {"step": 1}}, {"phase": "Suspended"})
        assert patch == {"phase": "Suspended", "lastCheckpoint": None}

    def test_secret_values_decode_from_data_or_string_data(self) -> None:
        assert h.decode_secret_value({"data": {"token": base64.b64encode(b"s3cret").decode()}}, "token") == "s3cret"
        assert h.decode_secret_value({"stringData": {"token": "plain"}}, "token") == "plain"
        assert h.decode_secret_value(None, "token") is None
        assert h.decode_secret_value({"data": {}}, "token") is None


class TestNamesTheOperatorDerives:
    def test_the_kv_bucket_follows_the_contract(self) -> None:
        assert kv_bucket("my-exp-2") == "kuberl_MY_EXP_2"

    @pytest.mark.parametrize(("kind", "ns", "name", "sub", "path"), [
        ("StatefulSet", "a", "x", "status", "/apis/apps/v1/namespaces/a/statefulsets/x/status"),
        ("ConfigMap", "a", None, None, "/api/v1/namespaces/a/configmaps"),
        ("Node", None, None, None, "/api/v1/nodes"),
        ("RLExperiment", "a", "x", "scale", "/apis/kuberl.io/v1alpha1/namespaces/a/rlexperiments/x/scale"),
    ])
    def test_rest_paths(self, kind: str, ns: str | None, name: str | None, sub: str | None, path: str) -> None:
        assert path_for(kind, ns, name, sub) == path

    def test_an_unknown_kind_is_a_clear_error(self) -> None:
        with pytest.raises(ValueError, match="does not know kind 'Gadget'"):
            path_for("Gadget", "a")


class TestOperatorSettings:
    def test_settings_keep_kopf_state_in_annotations_and_time_out_watches(self) -> None:
        settings = kopf.OperatorSettings()
        configure_settings(settings, standalone=False, clusterwide=True)
        assert settings.watching.server_timeout and settings.watching.client_timeout > settings.watching.server_timeout
        assert settings.peering.name == "kuberl" and settings.peering.standalone is False and settings.peering.clusterwide
        assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)

    def test_standalone_disables_peering(self) -> None:
        settings = kopf.OperatorSettings()
        configure_settings(settings, standalone=True, clusterwide=False)
        assert settings.peering.standalone is True


class TestOperatorEnvironment:
    def test_a_bad_interval_names_the_variable_and_the_value(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KUBERL_OPERATOR_INTERVAL", "soon")
        with pytest.raises(ValueError, match="KUBERL_OPERATOR_INTERVAL='soon' is not a number of seconds"):
            h.env_seconds("KUBERL_OPERATOR_INTERVAL", 5.0)
        monkeypatch.setenv("KUBERL_OPERATOR_INTERVAL", "0")
        with pytest.raises(ValueError, match="must be > 0"):
            h.env_seconds("KUBERL_OPERATOR_INTERVAL", 5.0)

    def test_unset_means_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("KUBERL_OPERATOR_INTERVAL", raising=False)
        assert h.env_seconds("KUBERL_OPERATOR_INTERVAL", 5.0) == 5.0


class TestFinishedAndReplicas:
    """B3 (finished from the refreshed status and the trainer, never an invalid spec's Failed) and
    B2 (the operator writes the resolved replica count, so /scale always reads it)."""

    def test_an_invalid_specs_failed_phase_is_not_finished(self) -> None:
        invalid = st.invalid_status({}, 2, ["spec.trainer.accelerator.count: bad"], T0)
        assert not h.finished(invalid, None, None)
        failed = {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": "MaxRestartsExceeded"}]}
        assert h.finished(failed, None, None)
        assert h.finished({"phase": "Succeeded"}, None, None)
        assert h.finished({"phase": "Running"}, {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}, None)
        assert h.finished({"phase": "Running"}, None, {"done": True})
        assert not h.finished({"phase": "Running"}, None, {"done": False})

    def test_the_resolved_replica_count_is_written_once_with_its_allocation(self) -> None:
        b = body(allocation="vllm:d4+fsdp:d4", trainer={"accelerator": {"type": "cpu", "count": 4}})
        exp = handlers.parse_experiment(b)
        replicas, patch = h.replicas_to_write(b, exp)
        assert replicas == 4 and patch["spec"] == {"rollout": {"replicas": 4}}
        assert patch["metadata"]["annotations"] == {h.REPLICAS_FROM_ANNOTATION: "vllm:d4+fsdp:d4"}
        b["spec"]["rollout"] = {"replicas": 4}
        b["metadata"]["annotations"][h.REPLICAS_FROM_ANNOTATION] = "vllm:d4+fsdp:d4"
        assert h.replicas_to_write(b, handlers.parse_experiment(b)) is None, "written once"
        assert h.replicas_to_write(body(), handlers.parse_experiment(body()))[0] == 1, "no allocation: the default is written too"

    def test_an_allocation_edit_moves_a_count_nobody_scaled_but_not_a_scaled_one(self) -> None:
        b = body(allocation="vllm:d8+fsdp:d4", rollout={"replicas": 4}, trainer={"accelerator": {"type": "cpu", "count": 4}})
        b["metadata"]["annotations"][h.REPLICAS_FROM_ANNOTATION] = "vllm:d4+fsdp:d4"
        assert h.replicas_to_write(b, handlers.parse_experiment(b))[0] == 8
        b["spec"]["rollout"]["replicas"] = 6  # kubectl scale'd since: an explicit count wins
        assert h.replicas_to_write(b, handlers.parse_experiment(b)) is None
