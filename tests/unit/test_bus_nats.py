"""The embedded NATS StatefulSet on a real cluster: a 3- or 5-server JetStream spreads over nodes and
zones (one node must not take the quorum down), and NATS gets requests (not BestEffort QoS)."""

from __future__ import annotations

import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders import build_bus_statefulset
from kuberl.operator.builders.bus import DEFAULT_REQUESTS


def experiment(**embedded) -> RLExperiment:
    return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "n", "namespace": "a"},
                                        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                                                 "bus": {"embedded": embedded}}})


def pod(exp: RLExperiment) -> dict:
    return build_bus_statefulset(exp)["spec"]["template"]


@pytest.mark.parametrize("replicas", [3, 5])
def test_a_clustered_bus_spreads_its_servers_over_nodes_and_zones(replicas) -> None:
    template = pod(experiment(replicas=replicas))
    labels = template["metadata"]["labels"]
    [term] = template["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    [spread] = template["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone" and spread["labelSelector"]["matchLabels"].items() <= labels.items()


def test_a_single_server_has_no_placement_rules() -> None:
    spec = pod(experiment(replicas=1))["spec"]
    assert "affinity" not in spec and "topologySpreadConstraints" not in spec


def test_nats_gets_requests_by_default_and_the_users_win() -> None:
    [c] = pod(experiment())["spec"]["containers"]
    assert c["resources"] == {"requests": DEFAULT_REQUESTS}
    [c] = pod(experiment(resources={"requests": {"cpu": "2"}, "limits": {"memory": "128Mi"}}))["spec"]["containers"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "128Mi"}, "limits": {"memory": "128Mi"}}


@pytest.mark.parametrize("image,ok", [
    ("", True), ("registry.example.com:5000/mirror/nats:2.15-alpine", True), ("nats@sha256:" + "a" * 64, True),
    ("Registry/NATS", False), ("nats 2.15", False), ("nats:", False),
])
def test_the_chart_and_the_operator_agree_on_the_nats_image(image, ok) -> None:
    """runtimeImages.nats reaches the operator as KUBERL_NATS_IMAGE and becomes the default NATS image."""
    import helm_python as helm
    from test_chart import CHART, one, render

    from kuberl.operator.builders import bus
    from kuberl.operator.main import NATS_IMAGE_ENV

    with helm.Chart.load(CHART) as chart:
        try:
            chart.validate_schema(chart.merge_values({"runtimeImages": {"nats": image}}))
            chart_ok = True
        except helm.HelmError:
            chart_ok = False
    try:
        bus.configure_nats_image(image)
        operator_ok = True
    except ValueError:
        operator_ok = False
    try:
        assert chart_ok == operator_ok == ok
        if ok and image:
            pod = one(render({"runtimeImages": {"nats": image}}), "Deployment")["spec"]["template"]["spec"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env[NATS_IMAGE_ENV] == image
            [c] = build_bus_statefulset(experiment())["spec"]["template"]["spec"]["containers"]
            assert c["image"] == image
    finally:
        bus.configure_nats_image(None)
