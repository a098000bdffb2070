"""Users minted on a shared NATS (spec.bus.external.accountSigningKeySecret): the rendered pods, the users
Secret, minting once, and clear errors for a bad key. The server's side is in
tests/integration/test_shared_nats_users.py (a real nats-server in JWT mode)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import kubernetes_validate
import nkeys
import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import bus_users, lifecycle, naming, nats_jwt
from kuberl.operator.builders import build_children, bus_auth
from kuberl.operator.progress import NatsCreds, _auth

SEED = nats_jwt.new_seed("account").decode()
ACCOUNT = nkeys.from_seed(bytearray(SEED.encode())).public_key.decode()


def experiment(**external: Any) -> RLExperiment:
    ext = {"url": "nats://nats.nats.svc:4222", "accountSigningKeySecret": {"name": "nats-account", "key": "seed"}, **external}
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
        "metadata": {"name": "gsm8k", "namespace": "team-a", "uid": "4f3a0c9e-12ab-4cde-8f00-0123456789ab"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "bus": {"external": ext}},
    })


def pod_specs(children: list[dict]) -> dict[str, dict]:
    return {c["metadata"]["name"]: c["spec"]["template"]["spec"] for c in children if c["kind"] in ("StatefulSet", "Job")}


def env_of(spec: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for c in spec["containers"] for e in c.get("env", [])}


def test_each_pod_gets_its_roles_minted_user_and_inbox_and_never_the_signing_key() -> None:
    exp = experiment()
    users = bus_users.mint(exp, SEED)
    children = build_children(exp, bus_users=users, engine_api_key="k")
    secret = next(c for c in children if c["metadata"]["name"] == naming.bus_users_secret_name(exp))
    assert sorted(secret["stringData"]) == ["rollout.creds", "trainer.creds"]
    kubernetes_validate.validate(secret, "1.31", strict=True)
    inbox = bus_auth.inbox_prefix(bus_auth.bus_objects(exp))
    specs = pod_specs(children)
    for name, role in ((naming.trainer_name(exp), "trainer"), (naming.rollout_name(exp), "rollout")):
        env = env_of(specs[name])
        assert env["KUBERL_BUS_CREDS"] == {"secretKeyRef": {"name": naming.bus_users_secret_name(exp), "key": f"{role}.creds"}}
        assert env["KUBERL_BUS_INBOX"] == inbox
        assert "KUBERL_BUS_TOKEN" not in env and "KUBERL_BUS_PASSWORD" not in env
    assert "nats-account" not in str(specs) and SEED not in str(children)  # the signing key stays with the operator


def test_a_minted_user_is_the_accounts_and_allowed_only_its_experiments_names() -> None:
    exp = experiment(account=ACCOUNT)
    users = bus_users.mint(exp, SEED)
    claims = nats_jwt.decode(users["rollout"].split("\n")[1])
    assert claims["nats"]["type"] == "user" and claims["iss"] == ACCOUNT and claims["name"] == "team-a/gsm8k/rollout"
    o = bus_auth.bus_objects(exp)
    assert claims["nats"]["sub"] == {"allow": [f"{bus_auth.inbox_prefix(o)}.>"]}
    trainer = nats_jwt.decode(users["trainer"].split("\n")[1])["nats"]["pub"]["allow"]
    assert "$JS.API.>" not in trainer and f"$KV.{o.kv_bucket}.>" in trainer
    assert all(o.prefix in s or o.kv_bucket in s or o.weights_bucket in s or s in ("$JS.API.INFO", "$JS.API.STREAM.NAMES")
               or any(stream in s for stream in o.streams) for s in trainer), "every subject names this experiment"
    # the signature is the signing key's
    header_payload, sig = users["trainer"].split("\n")[1].rsplit(".", 1)
    kp = nkeys.from_seed(bytearray(SEED.encode()))
    assert kp.verify(header_payload.encode(), base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4)))


def test_a_signing_key_seen_through_another_account_names_its_issuer_account() -> None:
    other = nkeys.from_seed(bytearray(nats_jwt.new_seed("account"))).public_key.decode()
    claims = nats_jwt.decode(bus_users.mint(experiment(account=other), SEED)["trainer"].split("\n")[1])
    assert claims["nats"]["issuer_account"] == other and claims["iss"] == ACCOUNT


@pytest.mark.parametrize("seed,why", [
    ("not-a-seed", "is not an nkey seed"),
    (nats_jwt.new_seed("user").decode(), "is a user key, not an account signing key"),
    (nats_jwt.new_seed("operator").decode(), "is a operator key, not an account signing key"),
], ids=["not-a-seed", "user-seed", "operator-seed"])  # fixed ids: the seeds are random
def test_a_bad_signing_key_is_a_clear_error_naming_the_field_and_never_the_seed(seed: str, why: str) -> None:
    with pytest.raises(bus_users.BusUsersError) as err:
        bus_users.mint(experiment(), seed)
    assert str(err.value).startswith("spec.bus.external.accountSigningKeySecret: Secret 'nats-account' key 'seed': ")
    assert why in str(err.value) and seed not in str(err.value)


class _Kube:
    def __init__(self, secrets: dict[str, dict]) -> None:
        self.secrets = secrets
        self.gets: list[str] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        assert kind == "Secret" and namespace == "team-a"
        self.gets.append(name)
        return self.secrets.get(name)


def test_users_are_minted_once_then_read_back_from_their_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    exp = experiment()
    kube = _Kube({"nats-account": {"stringData": {"seed": SEED}}})
    monkeypatch.setattr(lifecycle.CONFIG, "kube", kube)
    first = asyncio.run(bus_users.users_for_children(exp))
    assert set(first) == {"trainer", "rollout"}
    kube.secrets[naming.bus_users_secret_name(exp)] = {"stringData": {f"{r}.creds": first[r] for r in first}}
    again = asyncio.run(bus_users.users_for_children(exp))
    assert again == first  # not re-minted: running pods keep working users
    kube.secrets.pop("nats-account")
    assert asyncio.run(bus_users.users_for_children(exp)) == first  # the key is only needed to mint
    kube.secrets.pop(naming.bus_users_secret_name(exp))
    assert asyncio.run(bus_users.users_for_children(exp)) is None  # no key yet: referenced_secrets blocks the pods


def test_the_operator_reads_with_one_minted_user_per_account(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle.CONFIG, "kube", _Kube({"nats-account": {"stringData": {"seed": SEED}}}))
    url, creds = asyncio.run(lifecycle.bus_endpoint(experiment()))
    assert url == "nats://nats.nats.svc:4222" and isinstance(creds, NatsCreds)
    assert creds.inbox_prefix == bus_auth.OPERATOR_INBOX and SEED not in repr(creds)
    assert nats_jwt.decode(creds.text.split("\n")[1])["nats"]["pub"]["allow"] == bus_auth.operator_permissions()["publish"]["allow"]
    assert set(_auth(creds)) == {"user_credentials", "inbox_prefix"}
    monkeypatch.setattr(lifecycle.CONFIG, "kube", _Kube({"nats-account": {"stringData": {"seed": "garbage"}}}))
    assert asyncio.run(lifecycle.bus_endpoint(experiment(account=ACCOUNT)))[1] is None  # reported by apply (ApplyFailed)


def test_the_signing_key_secret_is_a_prerequisite() -> None:
    from kuberl.operator.observed import referenced_secrets

    assert ("spec.bus.external.accountSigningKeySecret", "nats-account", "seed") in referenced_secrets(experiment())


def test_the_runtime_refuses_a_minted_user_together_with_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from kuberl.runtime.bus.connection import CREDS_ENV, bus_credentials

    monkeypatch.setenv(CREDS_ENV, "-----BEGIN NATS USER JWT-----\nx\n")
    monkeypatch.delenv("KUBERL_BUS_USER", raising=False)
    monkeypatch.delenv("KUBERL_BUS_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="KUBERL_BUS_CREDS .* goes alone"):
        bus_credentials("a-token", None, None)
    assert bus_credentials(None, None, None) == (None, None, None)  # the user comes from KUBERL_BUS_CREDS alone
