"""Per-role NATS users of the embedded bus (issue 11, S4): the Secret, each pod's env, the permissions
and the runtime's reading of them. The same permissions against a real nats-server:
tests/integration/test_bus_users.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kubernetes_validate
import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import lifecycle, naming
from kuberl.operator.builders import build_children, bus_auth
from kuberl.operator.builders.bus import build_bus_secret, render_nats_conf
from kuberl.runtime.bus.connection import bus_credentials
from kuberl.runtime.bus.names import BusNames

TOKEN = "tok-" + "x" * 40
K8S_VERSION = "1.32"


def experiment(**spec: Any) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
        "metadata": {"name": "gsm8k", "namespace": "team-a", "uid": "4f3a0c9e-12ab-4cde-8f00-0123456789ab"},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, **spec},
    })


def children(exp: RLExperiment | None = None) -> list[dict[str, Any]]:
    return build_children(exp or experiment(), bus_token=TOKEN, engine_api_key="engine-key")


def bus_secret(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in objs if c["kind"] == "Secret" and c["metadata"]["name"] == "gsm8k-bus-credentials")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def bus_secret_keys(obj: dict[str, Any]) -> set[str]:
    """Every key of the bus Secret a workload's pods can see: env secretKeyRefs and Secret volumes."""
    pod = pod_spec(obj)
    keys = set()
    for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref and ref["name"] == "gsm8k-bus-credentials":
                keys.add(ref["key"])
        for src in c.get("envFrom", []):
            assert (src.get("secretRef") or {}).get("name") != "gsm8k-bus-credentials", "the whole Secret as env"
    for v in pod.get("volumes", []):
        if (v.get("secret") or {}).get("secretName") == "gsm8k-bus-credentials":
            items = v["secret"].get("items")
            assert items, "a volume of the whole bus Secret"
            keys |= {i["key"] for i in items}
    return keys


class TestSecret:
    def test_it_holds_the_token_a_password_per_role_and_the_conf_and_validates_strictly(self) -> None:
        secret = bus_secret(children())
        kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
        data = secret["stringData"]
        assert set(data) == {"token", "trainer-password", "rollout-password", "operator-password", "nats.conf"}
        passwords = [data[f"{r}-password"] for r in bus_auth.ROLES]
        assert len(set(passwords)) == 3 and TOKEN not in passwords and all(len(p) >= 40 for p in passwords)

    def test_passwords_are_stable_for_a_token_and_differ_between_experiments(self) -> None:
        assert bus_secret(children()) == bus_secret(children())  # a re-apply changes nothing
        other = build_bus_secret(experiment(), "another-random-token")["stringData"]
        assert all(other[f"{r}-password"] != bus_secret(children())["stringData"][f"{r}-password"] for r in bus_auth.ROLES)

    @pytest.mark.parametrize("call", [lambda: bus_auth.role_password(TOKEN, "admin"), lambda: bus_auth.password_key("root"),
                                      lambda: bus_auth.role_password("", "trainer")])
    def test_an_unknown_role_or_empty_token_is_refused(self, call: Any) -> None:
        with pytest.raises(ValueError, match="bus role|bus token"):
            call()

    def test_no_password_or_token_reaches_a_configmap_or_a_workload(self) -> None:
        objs = children()
        values = [TOKEN, *(bus_secret(objs)["stringData"][f"{r}-password"] for r in bus_auth.ROLES)]
        for obj in objs:
            if obj["kind"] == "Secret":
                continue
            text = json.dumps(obj)
            assert not any(v in text for v in values), f"{obj['kind']} {obj['metadata']['name']} holds a bus secret value"


class TestPods:
    def test_each_role_mounts_only_its_own_key(self) -> None:
        objs = {(c["kind"], c["metadata"]["name"]): c for c in children()}
        assert bus_secret_keys(objs[("StatefulSet", "gsm8k-rollout")]) == {"rollout-password"}
        assert bus_secret_keys(objs[("Job", "gsm8k-trainer")]) == {"trainer-password"}
        assert bus_secret_keys(objs[("StatefulSet", "gsm8k-bus")]) == {"nats.conf"}

    @pytest.mark.parametrize("kind,name,role", [("StatefulSet", "gsm8k-rollout", "rollout"), ("Job", "gsm8k-trainer", "trainer")])
    def test_each_runtime_container_names_its_user(self, kind: str, name: str, role: str) -> None:
        obj = next(c for c in children() if c["kind"] == kind and c["metadata"]["name"] == name)
        for c in pod_spec(obj)["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if "KUBERL_BUS_URL" not in env:
                continue
            assert env["KUBERL_BUS_USER"]["value"] == role and "KUBERL_BUS_TOKEN" not in env
            assert env["KUBERL_BUS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == f"{role}-password"

    def test_an_external_bus_keeps_its_token_secret(self) -> None:
        exp = experiment(bus={"external": {"url": "nats://nats.nats.svc:4222", "credentialsSecret": {"name": "nats-creds", "key": "token"}}})
        rollout = next(c for c in children(exp) if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "gsm8k-rollout")
        env = {e["name"]: e for c in pod_spec(rollout)["containers"] for e in c.get("env", [])}
        assert env["KUBERL_BUS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "nats-creds", "key": "token"}
        assert "KUBERL_BUS_USER" not in env and "KUBERL_BUS_PASSWORD" not in env


class TestPermissions:
    def objects(self) -> bus_auth.BusObjects:
        return bus_auth.bus_objects(experiment())

    @pytest.mark.parametrize("run", ["", "team-a.4f3a0c9e12ab"])
    def test_the_names_are_the_runtimes(self, run: str) -> None:
        exp = experiment()
        exp.metadata.annotations = {naming.BUS_RUN_ANNOTATION: run}
        o, n = bus_auth.bus_objects(exp), BusNames.for_experiment("gsm8k", run)
        assert (o.tickets_stream, o.traj_stream, o.kv_bucket, o.weights_bucket, o.metrics_stream) == (
            n.tickets_stream, n.traj_stream, n.kv_bucket, n.weights_bucket, n.metrics_stream)
        assert n.tickets_subject.startswith(o.prefix + ".") and n.traj_subject.startswith(o.prefix + ".")

    def test_the_rollout_user_may_not_write_weights_state_or_tickets_nor_delete_anything(self) -> None:
        o = self.objects()
        allow = bus_auth.permissions("rollout", o)["publish"]["allow"]
        assert not [s for s in allow if s.startswith(("$O.", "$KV.")) or ">" == s[-1:] and s.count(".") < 3]
        for verb in ("STREAM.DELETE", "STREAM.PURGE", "STREAM.UPDATE", "STREAM.MSG.DELETE"):
            assert not [s for s in allow if verb in s], verb
        assert not [s for s in allow if s.startswith(f"$JS.API.CONSUMER.DELETE.{o.tickets_stream}") or s.startswith(f"$JS.API.CONSUMER.DELETE.{o.traj_stream}")]
        assert f"{o.prefix}.tickets" not in allow and f"{o.prefix}.traj" in allow and f"{o.prefix}.eval.results" in allow
        assert not [s for s in allow if s.startswith(f"$JS.ACK.{o.traj_stream}")]  # never acks the trainer's groups

    def test_the_operator_user_writes_only_control(self) -> None:
        o = self.objects()
        allow = bus_auth.permissions("operator", o)["publish"]["allow"]
        assert [s for s in allow if s.startswith(("$KV.", "$O.", "kuberl."))] == [f"$KV.{o.kv_bucket}.control"]
        assert not [s for s in allow if o.tickets_stream in s or o.traj_stream in s or "STREAM.DELETE" in s or "PURGE" in s]

    def test_every_user_subscribes_to_inboxes_only(self) -> None:
        for role in bus_auth.ROLES:
            assert bus_auth.permissions(role, self.objects())["subscribe"] == {"allow": ["_INBOX.>"]}

    def test_the_conf_has_three_users_and_no_token(self) -> None:
        conf = render_nats_conf(experiment(), TOKEN)
        assert conf.count('"user": ') == 3 and "token" not in conf and TOKEN not in conf


class TestRuntimeCredentials:
    def test_a_user_and_password_come_from_the_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("KUBERL_BUS_TOKEN", raising=False)
        monkeypatch.setenv("KUBERL_BUS_USER", "rollout")
        monkeypatch.setenv("KUBERL_BUS_PASSWORD", "pw")
        assert bus_credentials(None, None, None) == (None, "rollout", "pw")

    def test_a_token_still_works_alone(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for var in ("KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("KUBERL_BUS_TOKEN", "t")
        assert bus_credentials(None, None, None) == ("t", None, None)

    @pytest.mark.parametrize("args,match", [(("t", "rollout", "pw"), "not both"), ((None, "rollout", None), "only the user"),
                                            ((None, None, "s3cret-pw"), "only the password")])
    def test_mixed_or_half_credentials_are_refused_without_showing_a_value(self, args: Any, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
        for var in ("KUBERL_BUS_TOKEN", "KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD"):
            monkeypatch.delenv(var, raising=False)
        with pytest.raises(ValueError, match=match) as err:
            bus_credentials(*args)
        assert "s3cret-pw" not in str(err.value)


class _Kube:
    def __init__(self, secret: dict[str, Any]) -> None:
        self.secret = secret

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        assert (kind, namespace, name) == ("Secret", "team-a", "gsm8k-bus-credentials")
        return self.secret


@pytest.mark.parametrize("secret,expected", [
    ({"stringData": {"token": TOKEN, "operator-password": "op-pw"}}, ("operator", "op-pw")),
    ({"stringData": {"token": TOKEN}}, TOKEN),  # a Secret from before bus users (pinned): token auth
])
def test_the_operator_reads_with_its_own_user(secret: dict[str, Any], expected: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle.CONFIG, "kube", _Kube(secret))
    url, creds = asyncio.run(lifecycle.bus_endpoint(experiment()))
    assert url == "nats://gsm8k-bus.team-a.svc:4222" and creds == expected


def test_a_bus_secret_not_created_yet_is_asked_for_again_on_the_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first reconcile refreshes status before it creates the bus Secret: a 404 then must not be kept for the
    token cache's 5 minutes (the scale bench saw every new experiment's bus read without credentials that long)."""
    kube = _Kube(None)  # type: ignore[arg-type]  # the API's answer for a Secret that does not exist yet
    monkeypatch.setattr(lifecycle.CONFIG, "kube", kube)
    memo: dict[str, Any] = {}
    assert asyncio.run(lifecycle.bus_endpoint(experiment(), memo))[1] is None
    kube.secret = {"stringData": {"token": TOKEN, "operator-password": "op-pw"}}  # apply_children created it
    assert asyncio.run(lifecycle.bus_endpoint(experiment(), memo))[1] == ("operator", "op-pw")
    kube.secret = {"stringData": {"token": TOKEN, "operator-password": "changed"}}
    assert asyncio.run(lifecycle.bus_endpoint(experiment(), memo))[1] == ("operator", "op-pw")  # found: kept (no GET a tick)


class _Conn:
    is_connected, is_closed = True, False


class TestRefusals:
    def test_a_timeout_after_a_refusal_is_a_busError_at_once_and_best_effort_refusals_do_not_count(self) -> None:
        from kuberl.runtime.bus.errors import BusError
        from kuberl.runtime.bus.outage import Outage, retry

        outage = Outage(_Conn(), publish_timeout=30.0)
        calls = []

        async def refused_put() -> None:
            calls.append(1)
            outage.on_denied('nats: permissions violation for publish to "$kv.kuberl_x.weights"')
            raise TimeoutError

        t0 = time.monotonic()
        with pytest.raises(BusError, match=r"write state 'weights': the bus at nats://b refused it \(permissions violation .*\$kv.kuberl_x.weights"):
            asyncio.run(retry(outage, "nats://b", "write state 'weights'", refused_put))
        assert calls == [1] and time.monotonic() - t0 < 1.0  # no retrying a refusal for 30 s

        outage = Outage(_Conn(), publish_timeout=0.3)
        outage.on_denied('nats: permissions violation for publish to "$js.api.stream.msg.delete.kuberl_x_traj"')
        assert outage.denied is None  # an agent's orphan-chunk clean-up: the trainer's sweep does it

        async def slow() -> None:
            outage.on_denied('nats: permissions violation for publish to "$js.api.stream.msg.delete.kuberl_x_traj"')
            raise TimeoutError

        with pytest.raises(BusError, match="not answering"):  # an ordinary timeout, retried until publish_timeout
            asyncio.run(retry(outage, "nats://b", "publish group g", slow))
