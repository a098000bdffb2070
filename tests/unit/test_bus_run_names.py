"""Bus names carry the run (namespace and uid) on a cluster: the runtime's names, the operator's
re-derived KV bucket and the env the builders give every role agree (issue 11, B6)."""

from __future__ import annotations

import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import naming
from kuberl.operator.builders import build_children
from kuberl.operator.progress import kv_bucket
from kuberl.runtime.bus.names import RUN_ENV, BusNames


def experiment(namespace: str = "team-a", uid: str | None = "4f3a0c9e-12ab-4cde-8f00-0123456789ab", **annotations: str) -> RLExperiment:
    meta = {"name": "gsm8k", "namespace": namespace, "annotations": annotations}
    if uid:
        meta["uid"] = uid
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": meta,
                                        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}}})


def every_name(n: BusNames) -> set[str]:
    return {n.tickets_stream, n.tickets_subject, n.traj_stream, n.traj_subject, n.chunk_subject, n.kv_bucket, n.weights_bucket}


def test_the_run_is_namespace_and_uid() -> None:
    assert naming.bus_run(experiment()) == "team-a.4f3a0c9e12ab"
    assert naming.bus_run(experiment(uid=None)) == ""  # an offline render: the plain names


def test_same_name_in_two_namespaces_or_recreated_shares_no_bus_object() -> None:
    runs = [naming.bus_run(experiment("team-a")), naming.bus_run(experiment("team-b")),
            naming.bus_run(experiment("team-a", uid="99999999-0000-0000-0000-000000000000"))]
    names = [every_name(BusNames.for_experiment("gsm8k", run)) for run in runs]
    assert not names[0] & names[1] and not names[0] & names[2] and not names[1] & names[2]


def test_subjects_sit_under_the_run_for_per_run_permissions() -> None:
    n = BusNames.for_experiment("gsm8k", "team-a.4f3a0c9e12ab")
    assert n.tickets_subject == "kuberl.team-a.4f3a0c9e12ab.gsm8k.tickets"
    assert n.chunk_subject.startswith("kuberl.team-a.4f3a0c9e12ab.")
    assert n.kv_bucket == "kuberl_GSM8K_TEAM_A_4F3A0C9E12AB"


def test_the_operator_derives_the_same_kv_bucket_as_the_runtime() -> None:
    for run in ("", "team-a.4f3a0c9e12ab", "x-y.z"):
        assert kv_bucket("my-exp", run) == BusNames.for_experiment("my-exp", run).kv_bucket


def test_without_a_run_the_names_are_those_of_the_contract(monkeypatch) -> None:
    monkeypatch.delenv(RUN_ENV, raising=False)
    assert BusNames.for_experiment("my-exp").tickets_stream == "KUBERL_MY_EXP_TICKETS"
    monkeypatch.setenv(RUN_ENV, "ns.abc")
    assert BusNames.for_experiment("my-exp").tickets_stream == "KUBERL_MY_EXP_NS_ABC_TICKETS"


@pytest.mark.parametrize("bad", ["Team-A.x", "a..b", "a.b.", "a b", "a_b", "x" * 101])
def test_a_bad_run_is_refused_naming_the_variable(bad) -> None:
    with pytest.raises(ValueError, match=RUN_ENV):
        BusNames.for_experiment("my-exp", bad)


def test_every_runtime_container_gets_the_run() -> None:
    exp = experiment()
    for child in build_children(exp, bus_token="t"):
        for c in (child.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
            if c["name"] == "nats":
                continue
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["KUBERL_BUS_RUN"] == "team-a.4f3a0c9e12ab", (child["kind"], c["name"])


def test_a_pinned_empty_run_keeps_an_old_experiments_plain_names() -> None:
    exp = experiment(**{"kuberl.io/bus-run": ""})
    assert naming.bus_run(exp) == ""
    rollout = next(c for c in build_children(exp, bus_token="t") if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "gsm8k-rollout")
    assert "KUBERL_BUS_RUN" not in {e["name"] for c in rollout["spec"]["template"]["spec"]["containers"] for e in c["env"]}
