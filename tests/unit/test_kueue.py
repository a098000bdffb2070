"""Kueue's pure rules (issue 11, citizenship): a suspended queued experiment asks for no quota; with
workflow.sandbox.placement pod the sandbox's pods are a PodSet of their own, none run before admission, and the admitted
flavours place them as they place the roles'. Queueing, admission,
eviction, preemption and PodsReady run against Kueue's real manager on the real control plane
(tests/integration/test_operator_kueue_real.py), what a queued experiment's tick costs the API server and the
queue-label and managedBy rules in tests/integration/test_operator_kueue_ticks.py."""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import kueue
from kuberl.operator import kueue_status as ks
from kuberl.operator.builders import build_children, build_rollout_statefulset, build_sandbox_deployment
from kuberl.operator.labels import SPEC_HASH_ANNOTATION


def test_a_suspended_queued_experiment_asks_for_no_quota() -> None:
    exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
                                       "metadata": {"name": "q3", "labels": {kueue.QUEUE_LABEL: "q"}},
                                       "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "suspend": True}})
    assert kueue.build_workload(exp)["spec"]["active"] is False
    assert kueue.gated(exp, None) is exp


# --- workflow.sandbox.placement pod: the sandbox's pods are counted, held back and placed like the roles' -------------
def queued(**sandbox: object) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "boxed", "namespace": "q", "labels": {kueue.QUEUE_LABEL: "q"}},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                 "workflow": {"reward": "repeat-digit", **({"sandbox": sandbox} if sandbox else {})}}})


def test_the_sandbox_pods_are_a_pod_set_of_the_workload_counted_as_its_replicas() -> None:
    exp = queued(placement="pod", replicas=3, resources={"requests": {"cpu": "2", "memory": "512Mi"}})
    pod_sets = {ps["name"]: ps for ps in kueue.build_workload(exp)["spec"]["podSets"]}
    assert set(pod_sets) == {"bus", "rollout", "trainer", ks.SANDBOX_POD_SET}
    sandbox = pod_sets[ks.SANDBOX_POD_SET]
    assert sandbox["count"] == 3
    assert sandbox["template"] == build_sandbox_deployment(sandbox_running(exp))["spec"]["template"]  # what the Deployment runs
    assert sandbox["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "512Mi"}
    # A suspended queued experiment asks for no quota, yet its Workload still says what it would run.
    suspended = exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": True})})
    assert {ps["name"]: ps["count"] for ps in kueue.build_workload(suspended)["spec"]["podSets"]}[ks.SANDBOX_POD_SET] == 3
    # placement process: the sandbox is a subprocess of the rollout agent, inside the rollout PodSet's pods
    assert ks.SANDBOX_POD_SET not in {ps["name"] for ps in kueue.build_workload(queued(placement="process"))["spec"]["podSets"]}


def sandbox_running(exp: RLExperiment) -> RLExperiment:
    return exp.model_copy(update={"spec": exp.spec.model_copy(update={"suspend": False})})


def test_a_queued_experiment_not_yet_admitted_runs_no_sandbox_pod() -> None:
    exp = queued(placement="pod", replicas=2)
    pending = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending"}]}}
    evicted = {"status": {"conditions": [{"type": "Admitted", "status": "True"}, {"type": "Evicted", "status": "True"}]}}
    for workload in (None, pending, evicted):
        gated = kueue.gated(exp, workload)
        [deployment] = [c for c in build_children(gated, bus_token="t") if c["kind"] == "Deployment"]
        assert deployment["spec"]["replicas"] == 0, workload
    admitted = {"status": {"conditions": [{"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True"}]}}
    assert build_sandbox_deployment(kueue.gated(exp, admitted))["spec"]["replicas"] == 2


def test_the_admitted_flavours_place_the_sandbox_pods_as_they_place_the_roles() -> None:
    exp = queued(placement="pod")
    toleration = {"key": "pool", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    where = {"nodeSelector": {"kuberl.test/pool": "cpu"}, "tolerations": [toleration]}
    ks.PLACEMENT[("q", "boxed")] = {ks.SANDBOX_POD_SET: where, "rollout": {"nodeSelector": {"kuberl.test/pool": "gpu"}, "tolerations": []}}
    try:
        placed = ks.place_child(build_sandbox_deployment(exp))
        spec = placed["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"kuberl.test/pool": "cpu"} and spec["tolerations"] == [toleration]
        assert placed["metadata"]["annotations"][SPEC_HASH_ANNOTATION] != build_sandbox_deployment(exp)["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
        rollout = ks.place_child(build_rollout_statefulset(exp))["spec"]["template"]["spec"]  # the roles keep their own
        assert rollout["nodeSelector"]["kuberl.test/pool"] == "gpu"
        ks.PLACEMENT[("q", "boxed")] = {"rollout": where}  # no sandbox assignment: the Deployment is left as built
        assert ks.place_child(build_sandbox_deployment(exp)) == build_sandbox_deployment(exp)
    finally:
        ks.PLACEMENT.pop(("q", "boxed"), None)


# --- trainer.topologyRequest: Kueue's topology-aware scheduling of the ranks ------------------------------------------
def test_the_trainer_pod_set_carries_the_topology_request_with_the_ranks_index_label() -> None:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "gang", "labels": {kueue.QUEUE_LABEL: "q"}},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                 "trainer": {"nodes": 3, "topologyRequest": {"required": "cloud.google.com/gce-topology-block"}}}})
    pod_sets = {ps["name"]: ps for ps in kueue.build_workload(exp)["spec"]["podSets"]}
    assert pod_sets["trainer"]["count"] == 3
    assert pod_sets["trainer"]["topologyRequest"] == {"required": "cloud.google.com/gce-topology-block",
                                                      "podIndexLabel": "batch.kubernetes.io/job-completion-index"}
    assert all("topologyRequest" not in ps for name, ps in pod_sets.items() if name != "trainer")
    unset = exp.model_copy(update={"spec": exp.spec.model_copy(update={"trainer": exp.spec.trainer.model_copy(update={"topology_request": None})})})
    assert "topologyRequest" not in {ps["name"]: ps for ps in kueue.build_workload(unset)["spec"]["podSets"]}["trainer"]
