"""The rollout pods' engine API key and the rollout agent's probes, as the builders render them.

The key lives in the engine Secret only; engine and agent read it by secretKeyRef. The agent container
gets a probe port and startup/readiness/liveness probes on it. kubernetes-validate strict passes for
every example (test_builders covers all of them with the engine Secret included). That the operator generates
the key once and keeps it is tested on the real control plane (tests/integration/test_operator_helm_upgrade.py).
"""

from __future__ import annotations

import json

import kubernetes_validate

from kuberl.api import load_experiments
from kuberl.operator import naming
from kuberl.operator.builders import build_children, build_engine_secret, build_rollout_statefulset
from kuberl.operator.builders.rollout import AGENT_CONTAINER, ENGINE_API_KEY_KEY, ENGINE_CONTAINER
from kuberl.runtime.inference.engine_auth import API_KEY_ENV
from kuberl.runtime.rollout.health import HEALTH_PORT_ENV
from tests.unit.test_builders import EXAMPLES, K8S_VERSION, TOKEN, containers, env_of, make_experiment

KEY = "the-Engine_key"


def test_engine_and_agent_read_the_key_from_the_engine_secret() -> None:
    exp = make_experiment()
    pods = containers(build_rollout_statefulset(exp))
    ref = {"secretKeyRef": {"name": naming.engine_secret_name(exp), "key": ENGINE_API_KEY_KEY}}
    for name in (ENGINE_CONTAINER, AGENT_CONTAINER):
        env = pods[name]["env"]
        assert env_of(pods[name])[API_KEY_ENV] == ref, name
        assert not any(e["name"] == API_KEY_ENV and "value" in e for e in env), name


def test_the_engine_secret_holds_the_key_and_comes_before_the_rollout_pods() -> None:
    exp = make_experiment()
    children = build_children(exp, bus_token=TOKEN, engine_api_key=KEY)
    names = [(c["kind"], c["metadata"]["name"]) for c in children]
    secret_at = names.index(("Secret", naming.engine_secret_name(exp)))
    assert secret_at < names.index(("StatefulSet", naming.rollout_name(exp)))
    secret = children[secret_at]
    assert secret["stringData"] == {ENGINE_API_KEY_KEY: KEY}
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    leaks = [n for c, n in zip(children, names, strict=True) if c["kind"] != "Secret" and KEY in json.dumps(c)]
    assert leaks == []
    # Without a key (callers that only look at the shape) no engine Secret is built.
    assert ("Secret", naming.engine_secret_name(exp)) not in [(c["kind"], c["metadata"]["name"]) for c in build_children(exp)]


def test_every_example_gets_the_engine_secret_with_an_external_bus_too() -> None:
    for path in EXAMPLES:
        for exp in load_experiments(path):
            kinds = [(c["kind"], c["metadata"]["name"]) for c in build_children(exp, bus_token=TOKEN, engine_api_key=KEY)]
            assert ("Secret", naming.engine_secret_name(exp)) in kinds, path.name
    external = make_experiment(bus={"external": {"url": "nats://nats.shared:4222"}})
    assert build_engine_secret(external, KEY) in build_children(external, engine_api_key=KEY)


def test_a_key_with_whitespace_is_refused() -> None:
    for bad in ("", "a b", "k\n"):
        try:
            build_engine_secret(make_experiment(), bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_the_agent_container_is_probed_on_its_own_port() -> None:
    agent = containers(build_rollout_statefulset(make_experiment()))[AGENT_CONTAINER]
    assert agent["ports"] == [{"name": "probes", "containerPort": naming.AGENT_HEALTH_PORT, "protocol": "TCP"}]
    assert env_of(agent)[HEALTH_PORT_ENV] == str(naming.AGENT_HEALTH_PORT)
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    assert agent["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "probes"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "probes"}
    # The readiness handler may wait up to 5 s on the engine's /health.
    assert agent["readinessProbe"]["timeoutSeconds"] > 5
    # Not the engine's port: the probes and the engine are separate processes.
    assert naming.AGENT_HEALTH_PORT != naming.ENGINE_PORT


def test_the_operator_names_the_env_vars_the_runtime_reads() -> None:
    """The builders cannot import the runtime (import boundaries), so they repeat two env var names."""
    from kuberl.operator.builders import rollout as builder
    from kuberl.runtime.inference.engine_auth import API_KEY_ENV
    from kuberl.runtime.rollout.health import HEALTH_PORT_ENV

    assert (builder.API_KEY_ENV, builder.HEALTH_PORT_ENV) == (API_KEY_ENV, HEALTH_PORT_ENV)
