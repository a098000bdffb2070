"""workflow.external on a cluster, as the builders render it: the episode key in its own Secret (read by secretKeyRef, in no
other object), the rollout agent's episode port on the pod and the rollout Service, and the NetworkPolicy rule that admits
it from the experiment's namespace and workflow.external.namespaces only. Without workflow.external none of it exists.
That the operator generates the key once and keeps it is tested on the real control plane
(tests/integration/test_operator_helm_upgrade.py, TestGeneratedKeys).
"""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from kuberl.operator import naming
from kuberl.operator.builders import (
    build_children,
    build_episode_secret,
    build_rollout_network_policy,
    build_rollout_service,
    build_rollout_statefulset,
)
from kuberl.operator.builders import rollout as builder
from kuberl.operator.builders.network import NAMESPACE_NAME_LABEL
from kuberl.operator.builders.rollout import AGENT_CONTAINER, ENGINE_API_KEY_KEY
from kuberl.runtime.rollout import episode_api
from tests.unit.test_builders import ENGINE_KEY, K8S_VERSION, TOKEN, containers, env_of, make_experiment

KEY = "the-Episode_key"
AGENT = {"workflow": {"type": "agent", "external": {"namespaces": ["agents", "team-a"]}}}


def external(**overrides):
    return make_experiment(**{**AGENT, **overrides})


def episode_rules(policy: dict) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": naming.EPISODE_PORT} in r.get("ports", [])]


def test_the_episode_key_has_a_secret_of_its_own_before_the_rollout_pods_and_nowhere_else() -> None:
    exp = external()
    children = build_children(exp, bus_token=TOKEN, engine_api_key=ENGINE_KEY, episode_api_key=KEY)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    at = names.index(("Secret", naming.episode_secret_name(exp)))
    assert at < names.index(("StatefulSet", naming.rollout_name(exp)))
    assert children[at]["stringData"] == {ENGINE_API_KEY_KEY: KEY}
    kubernetes_validate.validate(children[at], K8S_VERSION, strict=True)
    assert [n for c, n in zip(children, names, strict=True) if KEY in json.dumps(c)] == [("Secret", naming.episode_secret_name(exp))]
    # Not the engine's Secret: a user given the episode key to run agents gets no key to the engines.
    assert naming.episode_secret_name(exp) != naming.engine_secret_name(exp)


def test_without_external_agents_there_is_no_episode_secret_port_or_rule() -> None:
    exp = make_experiment(workflow={"type": "agent", "agent": "my.agent:run"})
    kinds = [(c["kind"], c["metadata"]["name"]) for c in build_children(exp, episode_api_key=KEY)]
    assert ("Secret", naming.episode_secret_name(exp)) not in kinds
    agent = containers(build_rollout_statefulset(exp))[AGENT_CONTAINER]
    assert [p["name"] for p in agent["ports"]] == ["probes"] and builder.EPISODE_KEY_ENV not in env_of(agent)
    assert [p["name"] for p in build_rollout_service(exp)["spec"]["ports"]] == ["http"]
    assert episode_rules(build_rollout_network_policy(exp)) == []


def test_the_agent_serves_the_episode_port_with_the_key_from_the_secret() -> None:
    exp = external()
    sts = build_rollout_statefulset(exp)
    kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    agent = containers(sts)[AGENT_CONTAINER]
    env = env_of(agent)
    assert env[builder.EPISODE_KEY_ENV] == {"secretKeyRef": {"name": naming.episode_secret_name(exp), "key": ENGINE_API_KEY_KEY}}
    assert env[builder.EPISODE_PORT_ENV] == str(naming.EPISODE_PORT) and env[builder.EPISODE_LISTEN_ENV] == "0.0.0.0"
    assert env[builder.EPISODE_ADVERTISE_ENV] == {"fieldRef": {"fieldPath": "status.podIP"}}  # base URLs name the pod itself
    assert {"name": "episodes", "containerPort": naming.EPISODE_PORT, "protocol": "TCP"} in agent["ports"]
    service = build_rollout_service(exp)
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    assert {"name": "episodes", "port": naming.EPISODE_PORT, "targetPort": "episodes", "protocol": "TCP"} in service["spec"]["ports"]


def test_the_policy_admits_the_episode_port_from_the_namespace_and_the_named_ones_only() -> None:
    policy = build_rollout_network_policy(external())
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    [rule] = episode_rules(policy)
    assert rule["from"] == [{"podSelector": {}},  # every pod of the experiment's namespace (team-a)
                            {"namespaceSelector": {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": ["agents"]}]}}]
    # The engine port stays this experiment's own; the episode port opens no other port.
    engine = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": naming.ENGINE_PORT} in r.get("ports", [])]
    assert engine and all(p["podSelector"].get("matchLabels") for r in engine for p in r["from"])
    only_own = episode_rules(build_rollout_network_policy(make_experiment(workflow={"type": "agent", "external": {}})))
    assert only_own == [{"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": naming.EPISODE_PORT}]}]


def test_a_key_with_whitespace_is_refused() -> None:
    for bad in ("", "a b", "k\n"):
        with pytest.raises(ValueError):
            build_episode_secret(external(), bad)


def test_the_operator_names_the_env_vars_the_runtime_reads() -> None:
    assert (builder.EPISODE_PORT_ENV, builder.EPISODE_LISTEN_ENV, builder.EPISODE_ADVERTISE_ENV, builder.EPISODE_KEY_ENV) == (
        episode_api.PORT_ENV, episode_api.LISTEN_ENV, episode_api.ADVERTISE_ENV, episode_api.KEY_ENV)
