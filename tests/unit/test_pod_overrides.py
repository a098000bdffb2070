"""Per-role pod template overrides (spec.rollout.podTemplate, spec.trainer.podTemplate): merged into the
rendered pods like KubeRay's and Kubeflow Trainer's podTemplateOverrides (issue 11, citizenship)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from pydantic import ValidationError
from test_pod_security import restricted_violations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders import build_children, build_rollout_statefulset, build_trainer_job
from kuberl.operator.builders.pod import merge_by

TRAINER_OVERRIDE = {
    "labels": {"team": "nlp", "kueue.x-k8s.io/pod-group-name": "g1"},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "HF_HOME", "value": "/nvme/hf"},
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}],
    "volumes": [{"name": "nvme", "hostPath": {"path": "/mnt/nvme"}}],
    "volumeMounts": [{"name": "nvme", "mountPath": "/nvme"}],
    "imagePullSecrets": [{"name": "harbor"}],
    "serviceAccountName": "trainer-irsa",
    "runtimeClassName": "nvidia",
    "schedulerName": "volcano",
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
                                   "labelSelector": {"matchLabels": {"kuberl.io/role": "trainer"}}}],
    "terminationGracePeriodSeconds": 1200,
}


def experiment(trainer: dict | None = None, rollout: dict | None = None) -> RLExperiment:
    spec = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "trainer": {"accelerator": {"type": "nvidia", "count": 1}}, "rollout": {}}
    if trainer:
        spec["trainer"]["podTemplate"] = trainer
    if rollout:
        spec["rollout"]["podTemplate"] = rollout
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
                                        "metadata": {"name": "ov", "namespace": "team-a"}, "spec": spec})


def pod(obj: dict) -> dict:
    return obj["spec"]["template"]


class TestTrainerOverrides:
    exp = experiment(TRAINER_OVERRIDE)

    def test_labels_and_annotations_are_added_and_the_selectors_labels_stay(self) -> None:
        meta = pod(build_trainer_job(self.exp))["metadata"]
        assert meta["labels"]["team"] == "nlp" and meta["labels"]["kuberl.io/role"] == "trainer"
        assert meta["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        assert "kuberl.io/config-hash" in meta["annotations"]

    def test_env_merges_by_name_theirs_win_ours_stay(self) -> None:
        [c] = pod(build_trainer_job(self.exp))["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["NCCL_DEBUG"]["value"] == "INFO" and env["HF_HOME"]["value"] == "/nvme/hf"
        assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "key"}
        assert "KUBERL_BUS_URL" in env and [e["name"] for e in c["env"]].count("HF_HOME") == 1

    def test_volumes_mounts_and_pod_fields(self) -> None:
        spec = pod(build_trainer_job(self.exp))["spec"]
        assert {"name": "nvme", "hostPath": {"path": "/mnt/nvme"}} in spec["volumes"]
        assert {"name": "nvme", "mountPath": "/nvme"} in spec["containers"][0]["volumeMounts"]
        assert spec["imagePullSecrets"] == [{"name": "harbor"}]
        assert (spec["serviceAccountName"], spec["runtimeClassName"], spec["schedulerName"]) == ("trainer-irsa", "nvidia", "volcano")
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
        assert spec["terminationGracePeriodSeconds"] == 1200

    def test_the_other_role_is_untouched(self) -> None:
        spec = pod(build_rollout_statefulset(self.exp))["spec"]
        assert spec["serviceAccountName"] == "ov-runtime" and "imagePullSecrets" not in spec
        assert all("NCCL_DEBUG" not in {e["name"] for e in c["env"]} for c in spec["containers"])

    def test_every_child_still_passes_strict_validation(self) -> None:
        for child in build_children(self.exp, bus_token="t"):
            kubernetes_validate.validate(child, "1.32", strict=True)

    def test_pod_security_still_judges_what_the_user_adds(self) -> None:
        """A hostPath volume is the user's choice, and Pod Security "restricted" still says so."""
        assert restricted_violations(pod(build_trainer_job(self.exp))["spec"]) == ["volume nvme: type hostPath is not allowed"]


def test_rollout_env_reaches_engine_and_agent() -> None:
    exp = experiment(rollout={"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}], "runtimeClassName": "nvidia"})
    spec = pod(build_rollout_statefulset(exp))["spec"]
    assert {c["name"] for c in spec["containers"] if "HTTPS_PROXY" in {e["name"] for e in c["env"]}} == {"engine", "rollout-agent"}
    assert spec["runtimeClassName"] == "nvidia"


def test_a_pod_template_change_does_not_rewrite_experiment_yaml() -> None:
    """Pods act on the override through their template; experiment.yaml (and its hash) stay."""
    a, b = (next(c for c in build_children(e, bus_token="t") if c["kind"] == "ConfigMap") for e in (experiment(), experiment(TRAINER_OVERRIDE)))
    assert a["data"] == b["data"]


@pytest.mark.parametrize("override,field", [
    ({"labels": {"kuberl.io/experiment": "x"}}, "kuberl.io/"),
    ({"annotations": {"app.kubernetes.io/name": "x"}}, "kuberl.io/"),
    ({"env": [{"name": "KUBERL_BUS_TOKEN", "value": "x"}]}, "KUBERL_"),
    ({"volumes": [{"name": "checkpoints", "emptyDir": {}}]}, "checkpoints"),
    ({"volumeMounts": [{"mountPath": "/x"}]}, "needs a name"),
    ({"env": [{"name": "A", "vlue": "typo"}]}, "vlue"),
])
def test_reserved_or_malformed_overrides_are_refused_naming_the_problem(override, field) -> None:
    with pytest.raises(ValidationError) as err:
        experiment(override)
    assert field in str(err.value)


def test_merge_by_replaces_in_place_and_appends_new() -> None:
    ours = [{"name": "a", "value": "1"}, {"name": "b", "value": "2"}]
    assert merge_by("name", ours, [{"name": "b", "value": "3"}, {"name": "c", "value": "4"}]) == [
        {"name": "a", "value": "1"}, {"name": "b", "value": "3"}, {"name": "c", "value": "4"}]
