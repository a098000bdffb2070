"""weightSync.mode broadcast: the API field, admission (CEL and the models) refusing what it cannot do, the operator's trainer env and policies."""

from __future__ import annotations

import copy

import pytest

from kuberl.api import RLExperiment
from kuberl.api.infra import BROADCAST_NEEDS_VLLM, BROADCAST_NO_LORA
from kuberl.api.validation import check_cel, check_models, crd_schema, prune_and_default
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import network
from kuberl.operator.builders.trainer import WEIGHT_SYNC_HOST_ENV, WEIGHT_SYNC_PORT_ENV, build_trainer_job

BASE = {
    "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "bc", "namespace": "ns"},
    "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "rollout": {"engine": "vllm"},
             "weightSync": {"mode": "broadcast"}, "training": {"totalSteps": 3}},
}


def manifest(**spec) -> dict:
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
    return doc


def cel_errors(doc: dict) -> list:
    schema = crd_schema()
    return check_cel(schema, prune_and_default(schema, doc, "", []))


def test_broadcast_is_accepted_with_its_defaults():
    exp = RLExperiment.model_validate(manifest())
    ws = exp.spec.weight_sync
    assert (ws.mode, ws.bucket_mb, ws.port, ws.join_timeout_seconds, ws.timeout_seconds) == ("broadcast", 256, 29600, 10, 300)
    assert cel_errors(manifest()) == [] and check_models(manifest()) == []


@pytest.mark.parametrize("spec, message, field", [
    ({"rollout": {"engine": "sglang"}}, BROADCAST_NEEDS_VLLM, "spec.weightSync.mode"),
    ({"algorithm": {"lora": {"rank": 8, "alpha": 16}}}, BROADCAST_NO_LORA, "spec.weightSync.mode"),
])
def test_admission_refuses_what_broadcast_cannot_do(spec, message, field):
    doc = manifest(**spec)
    assert [e.message for e in cel_errors(doc)] == [message]  # the API server's CEL rule
    assert [(e.path, e.message) for e in check_models(doc)] == [(field, message)]  # and the models (kuberl run, the operator)
    assert cel_errors(manifest(**spec, weightSync={"mode": "bus"})) == []


def test_sglang_allocation_shorthand_is_refused_too():
    doc = manifest()
    doc["spec"].pop("rollout")
    doc["spec"]["allocation"] = "sglang:d1+fsdp:d1"
    assert BROADCAST_NEEDS_VLLM in [e.message for e in cel_errors(doc)]


@pytest.mark.parametrize("field, value", [("bucketMB", 0), ("port", 80), ("timeoutSeconds", 1), ("mode", "nccl")])
def test_bad_weight_sync_fields_are_refused(field, value):
    with pytest.raises(ValueError, match=field if field != "mode" else "disk"):
        RLExperiment.model_validate(manifest(weightSync={field: value}))


def test_trainer_gets_the_rendezvous_env_and_port_only_with_broadcast():
    (c,) = build_trainer_job(RLExperiment.model_validate(manifest(weightSync={"port": 29777})))["spec"]["template"]["spec"]["containers"]
    exp = RLExperiment.model_validate(manifest())
    assert {"name": WEIGHT_SYNC_HOST_ENV, "value": naming.trainer_master_address(exp)} in c["env"]
    assert {"name": WEIGHT_SYNC_PORT_ENV, "value": "29777"} in c["env"]
    assert {"name": "weight-sync", "containerPort": 29777, "protocol": "TCP"} in c["ports"]
    (d,) = build_trainer_job(RLExperiment.model_validate(manifest(weightSync={"mode": "disk"})))["spec"]["template"]["spec"]["containers"]
    assert not any(e["name"].startswith("KUBERL_WEIGHT_SYNC") for e in d["env"]) and not any(p["name"] == "weight-sync" for p in d["ports"])


def test_network_policies_let_trainer_and_engines_reach_each_other_only_with_broadcast():
    exp = RLExperiment.model_validate(manifest())
    trainer_pods = {"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.TRAINER)}}
    rollout_pods = {"podSelector": {"matchLabels": L.selector_labels(exp, L.Role.ROLLOUT)}}
    for build in (network.build_trainer_network_policy, network.build_rollout_network_policy):
        rules = build(exp)["spec"]["ingress"]
        assert {"from": [trainer_pods, rollout_pods]} in rules, build.__name__  # every port: gloo/NCCL peers use run-time ports
        other = build(RLExperiment.model_validate(manifest(weightSync={"mode": "bus"})))["spec"]["ingress"]
        assert not any(rollout_pods in r["from"] and "ports" not in r for r in other), build.__name__
