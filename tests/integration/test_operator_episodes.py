"""workflow.external on the real control plane (test_operator.py's: kube-apiserver, etcd, controllers, KWOK nodes, the
chart's operator): the API server admits the CRD's new rules and refuses an agent with external agents too; the operator
creates the episode key's Secret (owned, in no other object), the rollout Service's episodes port, and a NetworkPolicy
the API server accepts, admitting the port from the experiment's namespace and the named ones.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_operator import NS, RLX, Api, manifest, owned_by

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

@pytest.fixture(scope="module")
def api(kuberl_installed: Any) -> Iterator[Api]:
    if not kuberl_installed.local:
        pytest.skip("reads the operator's children on the local control plane (KUBECONFIG unset)")
    yield Api(kuberl_installed.control_plane, kuberl_installed.operator)


EXTERNAL = {"type": "agent", "external": {"namespaces": ["agents"]}, "reward": "repeat-digit"}


def test_admission_refuses_an_in_pod_agent_and_external_agents_together(api: Api, experiment_name: str) -> None:
    refused = api.call("POST", RLX, manifest(experiment_name, workflow={**EXTERNAL, "agent": "my.agent:run"}), ok=(422,))
    assert "set workflow.agent (an in-pod function) or workflow.external" in json.dumps(refused)


def test_external_agents_get_a_secret_key_a_service_port_and_a_policy_on_a_real_cluster(api: Api, experiment_name: str) -> None:
    e = experiment_name
    uid = api.call("POST", RLX, manifest(e, workflow=EXTERNAL))["metadata"]["uid"]
    secret = api.wait("the episode Secret", lambda: api.get(f"/api/v1/namespaces/{NS}/secrets/{e}-episode-api"))
    assert owned_by(secret, uid), secret["metadata"]
    assert len(secret["data"]["apiKey"]) >= 40  # base64 of a 32-byte token
    service = api.wait("the rollout Service", lambda: api.get(f"/api/v1/namespaces/{NS}/services/{e}-rollout"))
    assert {"name": "episodes", "port": 8002} in [{k: p[k] for k in ("name", "port")} for p in service["spec"]["ports"]]
    policy: Any = api.wait("the rollout NetworkPolicy", lambda: api.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{e}-rollout"))
    [rule] = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 8002} in r.get("ports", [])]
    assert rule["from"][0] == {"podSelector": {}} and rule["from"][1]["namespaceSelector"]["matchExpressions"][0]["values"] == ["agents"]
    sts = api.wait("the rollout StatefulSet", lambda: api.sts(f"{e}-rollout"))
    agent = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "rollout-agent")
    env = {x["name"]: x.get("valueFrom", x.get("value")) for x in agent["env"]}
    assert env["KUBERL_EPISODE_API_KEY"] == {"secretKeyRef": {"name": f"{e}-episode-api", "key": "apiKey"}}
    plain = base64.b64decode(secret["data"]["apiKey"]).decode()
    for path in (f"/api/v1/namespaces/{NS}/configmaps/{e}-config", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{e}-rollout", f"{RLX}/{e}"):
        assert plain not in json.dumps(api.get(path)), path
