"""Per-experiment users on a shared NATS in JWT mode (spec.bus.external.accountSigningKeySecret), on a REAL
nats-server run with an operator, an account and a signing key of it, as `nsc` would set it up (issue 11).

Two experiments of the same name in two namespaces share the account. With the users the operator mints
(kuberl.operator.bus_users, the code the handlers run), each role does its work; neither experiment can
read, write or delete the other's streams, KV, weights or replies; the rollout user cannot touch its own
experiment's weights; and the operator reads both experiments' progress through one connection.
Each refusal is checked on the server's side as well: the data stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import nkeys
import pytest
from bus_users_common import group, refused, ticket  # tests/integration/bus_users_common.py

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.net import free_port
from kuberl.operator import bus_users, naming, nats_jwt
from kuberl.operator.builders import bus_auth
from kuberl.operator.progress import BusReader
from kuberl.runtime.bus import Bus, BusError
from kuberl.runtime.bus.connection import CREDS_ENV, INBOX_ENV
from kuberl.runtime.bus.names import KEY_PROGRESS, KEY_WEIGHTS, RUN_ENV
from kuberl.runtime.bus.server import find_nats_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def experiment(namespace: str, uid: str, url: str, account: str) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
        "metadata": {"name": "gsm8k", "namespace": namespace, "uid": uid},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                 "bus": {"external": {"url": url, "accountSigningKeySecret": {"name": "nats-account", "key": "seed"}, "account": account}}},
    })


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """nats-server in JWT mode: an operator, a JetStream account with a signing key, a system account."""
    tmp = tmp_path_factory.mktemp("shared-nats")
    op = nkeys.from_seed(bytearray(nats_jwt.new_seed("operator")))
    account = nkeys.from_seed(bytearray(nats_jwt.new_seed("account")))
    signing_seed = nats_jwt.new_seed("account")
    signing = nkeys.from_seed(bytearray(signing_seed))
    system = nkeys.from_seed(bytearray(nats_jwt.new_seed("account")))
    acc_pub, sys_pub = account.public_key.decode(), system.public_key.decode()
    port = free_port("127.0.0.1")
    (tmp / "nats.conf").write_text(f"""
listen: 127.0.0.1:{port}
max_control_line: 16KB  # docs/operations.md: a minted user's JWT (its permissions) is 5-8 KB; the default line is 4 KB
operator: {nats_jwt.operator_jwt(op, "kuberl-test")}
system_account: {sys_pub}
resolver: MEMORY
resolver_preload: {{
  {acc_pub}: {nats_jwt.account_jwt(op, acc_pub, "ml-team", [signing.public_key.decode()])}
  {sys_pub}: {nats_jwt.account_jwt(op, sys_pub, "SYS", jetstream=False)}
}}
jetstream {{ store_dir: "{tmp / 'js'}" }}
""")
    log = open(tmp / "nats.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([find_nats_server(), "-c", str(tmp / "nats.conf"), "--name", f"shared-{uuid.uuid4().hex[:8]}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"nats://127.0.0.1:{port}"
    a = experiment("team-a", "4f3a0c9e-12ab-4cde-8f00-0123456789ab", url, acc_pub)
    b = experiment("team-b", "9c1d2e3f-0000-4cde-8f00-0123456789ab", url, acc_pub)
    users = {"a": bus_users.mint(a, signing_seed.decode()), "b": bus_users.mint(b, signing_seed.decode())}
    try:
        asyncio.run(_wait_up(url, users["a"][bus_auth.TRAINER]))
        yield {"url": url, "a": a, "b": b, "users": users, "seed": signing_seed.decode(), "log": tmp / "nats.log"}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


async def _wait_up(url: str, creds: str) -> None:
    from nats.aio.client import RawCredentials

    deadline = time.monotonic() + 20
    while True:
        try:
            nc = await nats.connect(url, user_credentials=RawCredentials(creds), connect_timeout=1, allow_reconnect=False, error_cb=_quiet)
            await nc.close()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _quiet(exc: Exception) -> None:
    return None


@contextlib.contextmanager
def as_role(env: dict, which: str, role: str) -> Iterator[None]:
    """The env a pod of experiment `which` in `role` gets (builders.common.bus_env): its own user, inbox and run."""
    exp = env[which]
    values = {CREDS_ENV: env["users"][which][role], INBOX_ENV: bus_auth.inbox_prefix(bus_auth.bus_objects(exp)), RUN_ENV: naming.bus_run(exp)}
    old = {k: os.environ.get(k) for k in (*values, "KUBERL_BUS_TOKEN", "KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD")}
    for k in ("KUBERL_BUS_TOKEN", "KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD"):
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def connect(env: dict, which: str, role: str, **kw) -> Bus:
    with as_role(env, which, role):
        return await Bus.connect(env["url"], "gsm8k", connect_timeout=5, publish_timeout=5, **kw)


async def raw(env: dict, which: str, role: str, denied: list[str]) -> nats.NATS:
    from nats.aio.client import RawCredentials

    async def on_error(exc: Exception) -> None:
        denied.append(str(exc).lower())

    prefix = bus_auth.inbox_prefix(bus_auth.bus_objects(env[which]))
    return await nats.connect(env["url"], user_credentials=RawCredentials(env["users"][which][role]), inbox_prefix=prefix, error_cb=on_error)


def test_each_role_of_each_experiment_does_its_work_on_the_shared_account(shared: dict, tmp_path: Path) -> None:
    async def go() -> None:
        for which in ("a", "b"):
            trainer = await connect(shared, which, bus_auth.TRAINER)
            await trainer.reset_experiment()
            await trainer.reset_trainer_consumer()
            weights = tmp_path / f"w-{which}"
            weights.mkdir()
            (weights / "model.safetensors").write_bytes(which.encode() * 70_000)
            prefix = await trainer.put_weights(1, weights)
            await trainer.put_state(KEY_WEIGHTS, {"version": 1, "mode": "bus", "object": prefix})
            await trainer.put_state(KEY_PROGRESS, {"step": 3 if which == "a" else 5, "total_steps": 10, "done": False})
            assert await trainer.publish_tickets([ticket(f"t-{which}")]) == 1

            rollout = await connect(shared, which, bus_auth.ROLLOUT)
            assert (await rollout.get_state(KEY_WEIGHTS))["object"] == prefix
            await rollout.get_weights(prefix, tmp_path / f"got-{which}")
            assert (tmp_path / f"got-{which}" / "model.safetensors").read_bytes() == which.encode() * 70_000
            lease = await rollout.pull_ticket(timeout=5)
            assert lease is not None and lease.value.ticket_id == f"t-{which}"  # its own ticket, never the other's
            assert await rollout.publish_group(group(lease.value))
            await lease.ack()
            got = await trainer.pull_groups(1, timeout=5)
            assert [g.value.group_id for g in got] == [f"t-{which}"]
            await got[0].ack()
            # its own weights are the trainer's alone
            assert "refused" in await refused(rollout.put_state(KEY_WEIGHTS, {"version": 99, "mode": "bus", "object": "v99"}))
            assert "refused" in await refused(rollout.put_weights(2, weights))
            await rollout.close()
            await trainer.close()

    asyncio.run(go())


def test_one_experiment_cannot_read_write_or_delete_the_others_objects(shared: dict) -> None:
    async def go() -> None:
        b_trainer = await connect(shared, "b", bus_auth.TRAINER)
        await b_trainer.put_state(KEY_WEIGHTS, {"version": 7})
        await b_trainer.publish_tickets([ticket("t-b-secret")])
        b = b_trainer.names
        pending_before = (await b_trainer.stream_info())["tickets_pending"]

        for role in (bus_auth.TRAINER, bus_auth.ROLLOUT):
            denied: list[str] = []
            nc = await raw(shared, "a", role, denied)
            await nc.publish(f"$JS.API.STREAM.DELETE.{b.traj_stream}", b"")  # the other trainer's reset
            await nc.publish(f"$JS.API.STREAM.PURGE.{b.tickets_stream}", b"")
            await nc.publish(f"$KV.{b.kv_bucket}.{KEY_WEIGHTS}", b'{"version": 666}')
            await nc.publish(f"$JS.API.DIRECT.GET.KV_{b.kv_bucket}.$KV.{b.kv_bucket}.{KEY_WEIGHTS}", b"")
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{b.tickets_stream}.agents", b'{"batch": 1}')
            await nc.subscribe("_INBOX.>")  # everybody's replies on the default prefix
            await nc.subscribe(f"{bus_auth.inbox_prefix(bus_auth.bus_objects(shared['b']))}.>")  # the other's replies
            await nc.flush()
            await asyncio.sleep(0.5)
            await nc.close()
            assert sum("permissions violation for publish" in d for d in denied) == 5, (role, denied)
            assert sum("permissions violation for subscription" in d for d in denied) == 2, (role, denied)

        # ... and on the server, B's objects are as its trainer left them.
        assert await b_trainer.get_state(KEY_WEIGHTS) == {"version": 7}
        assert (await b_trainer.stream_info())["tickets_pending"] == pending_before >= 1
        await b_trainer.js.stream_info(b.traj_stream)
        await b_trainer.close()

    asyncio.run(go())


def test_the_operator_reads_every_experiments_progress_through_one_connection(shared: dict) -> None:
    async def go() -> None:
        for which, step in (("a", 11), ("b", 22)):
            trainer = await connect(shared, which, bus_auth.TRAINER)
            await trainer.put_state(KEY_PROGRESS, {"step": step, "total_steps": 30, "done": False})
            await trainer.close()
        reader = BusReader(connect_timeout=5)
        creds = [bus_users.operator_user(shared[which], shared["seed"]) for which in ("a", "b")]
        assert creds[0] is creds[1]  # one user per account and process
        got = [await reader.read(shared["url"], creds[0], "gsm8k", run=naming.bus_run(shared[which])) for which in ("a", "b")]
        assert [g["step"] for g in got] == [11, 22]
        assert reader.connects == 1
        assert await reader.request_checkpoint(shared["url"], creds[0], "gsm8k", "ckpt-1", run=naming.bus_run(shared["a"]))
        trainer = await connect(shared, "a", bus_auth.TRAINER)
        assert (await trainer.get_state("control"))["checkpoint_request"] == "ckpt-1"
        await reader.close()

        from nats.aio.client import RawCredentials

        nc = await nats.connect(shared["url"], user_credentials=RawCredentials(creds[0].text), inbox_prefix=creds[0].inbox_prefix)
        kv = await nc.jetstream().key_value(trainer.names.kv_bucket)
        with pytest.raises(Exception):  # noqa: B017, PT011 - refused: no answer comes (a timeout)
            await kv.put(KEY_PROGRESS, b'{"step": 99, "done": true}', timeout=2)
        await nc.close()
        assert (await trainer.get_state(KEY_PROGRESS))["step"] == 11
        await trainer.close()

    asyncio.run(go())


def test_a_user_minted_by_another_account_is_not_let_in(shared: dict) -> None:
    async def go() -> None:
        stranger = nats_jwt.new_seed("account").decode()  # a key the server's operator never signed
        creds = bus_users.mint(shared["a"].model_copy(update={}), stranger)
        with as_role(shared, "a", bus_auth.ROLLOUT):
            os.environ[CREDS_ENV] = creds[bus_auth.ROLLOUT]
            with pytest.raises(BusError, match="authorization failed, check KUBERL_BUS_CREDS"):
                await Bus.connect(shared["url"], "gsm8k", connect_timeout=3)

    asyncio.run(go())
