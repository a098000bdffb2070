"""An experiment on a shared external NATS in JWT mode (spec.bus.external.accountSigningKeySecret): the
operator mints the experiment's own trainer and rollout users into `{name}-bus-users`, each pod reads its
role's key only and never the signing key; a signing key that is not one is reported (Reconciled=False,
ApplyFailed, naming the field) instead of crashing the reconcile. Only kubectl touches the cluster and no
pod needs to run, so this runs unchanged against the local control plane and a real cluster. The NATS side (the
server enforcing those users) is tests/integration/test_shared_nats_users.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl.operator import nats_jwt

Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]


def manifest(name: str, secret: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {"model": {"builtin": "tiny-qwen2", "dtype": "float32"}, "dataset": {"builtin": "repeat-digit"},
                 "rollout": {"engine": "vllm", "accelerator": {"type": "cpu", "count": 0}},
                 "trainer": {"accelerator": {"type": "cpu", "count": 1}},
                 "bus": {"external": {"url": "nats://nats.nats.svc:4222", "accountSigningKeySecret": {"name": secret, "key": "seed"}}},
                 "training": {"totalSteps": 5}},
    })


def secret(name: str, seed: str) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque", "stringData": {"seed": seed}})


def secret_data(c: Cluster, name: str) -> dict[str, str]:
    return c.json("get", "secret", name).get("data") or {}  # stringData is write-only: a cluster returns data


def env_of(c: Cluster, kind: str, name: str) -> dict[str, Any]:
    spec = c.json("get", kind, name)["spec"]["template"]["spec"]
    return {e["name"]: e.get("valueFrom", e.get("value")) for ct in spec["containers"] for e in ct.get("env", [])}


def test_the_operator_mints_each_roles_user_and_pods_read_their_own(cluster: Cluster) -> None:
    name = "e2e-shared-nats"
    seed = nats_jwt.new_seed("account").decode()
    cluster.kubectl("apply", "-f", str(ROOT / "crds"), namespaced=False)
    cluster.kubectl("apply", "-f", "-", stdin=secret("nats-account", seed))
    cluster.kubectl("apply", "-f", "-", stdin=manifest(name, "nats-account"))
    users = cluster.wait("the users Secret", lambda: cluster.kubectl("get", "secret", f"{name}-bus-users", check=False).returncode == 0)
    assert users
    keys = sorted(secret_data(cluster, f"{name}-bus-users"))
    assert keys == ["rollout.creds", "trainer.creds"]
    cluster.wait("the trainer Job", lambda: cluster.kubectl("get", "job", f"{name}-trainer", check=False).returncode == 0)
    for kind, obj, role in (("job", f"{name}-trainer", "trainer"), ("statefulset", f"{name}-rollout", "rollout")):
        env = env_of(cluster, kind, obj)
        assert env["KUBERL_BUS_CREDS"] == {"secretKeyRef": {"name": f"{name}-bus-users", "key": f"{role}.creds"}}
        assert "nats-account" not in str(env)
    before = secret_data(cluster, f"{name}-bus-users")
    cluster.kubectl("annotate", "rlx", name, "e2e/touch=1")  # another reconcile: the users are kept, not re-minted
    cluster.wait("the reconcile after the touch", lambda: (cluster.json("get", "rlx", name).get("status") or {}).get("observedGeneration") is not None)
    assert secret_data(cluster, f"{name}-bus-users") == before
    cluster.kubectl("delete", "rlx", name, "--wait=false")


def test_a_signing_key_that_is_not_one_is_a_condition_naming_the_field(cluster: Cluster) -> None:
    name = "e2e-shared-nats-bad-key"
    cluster.kubectl("apply", "-f", str(ROOT / "crds"), namespaced=False)
    cluster.kubectl("apply", "-f", "-", stdin=secret("nats-user-key", nats_jwt.new_seed("user").decode()))
    cluster.kubectl("apply", "-f", "-", stdin=manifest(name, "nats-user-key"))

    def reconciled() -> dict | None:
        conds = (cluster.json("get", "rlx", name).get("status") or {}).get("conditions") or []
        cond = next((x for x in conds if x["type"] == "Reconciled" and x["status"] == "False"), None)
        return cond

    cond = cluster.wait("Reconciled=False", reconciled)
    assert cond["reason"] == "ApplyFailed"
    assert "spec.bus.external.accountSigningKeySecret: Secret 'nats-user-key' key 'seed': " in cond["message"]
    assert "is a user key, not an account signing key" in cond["message"]
    assert cluster.kubectl("get", "secret", f"{name}-bus-users", check=False).returncode != 0
    cluster.kubectl("delete", "rlx", name, "--wait=false")
