"""Per-role NATS users on a REAL nats-server started with the nats.conf the operator renders (issue 11).

The trainer publishes weights and progress; the rollout user reads them, pulls and acks a ticket,
publishes a group and an evaluation result, and is refused (a BusError that says so, within seconds)
when it tries to put weights, write a KV key or delete a stream; the operator user reads progress and
writes only `control`. Each refusal is also checked on the server's side: the data stays unchanged.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from bus_users_common import group, refused, ticket  # tests/integration/bus_users_common.py

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.net import free_port
from kuberl.operator import naming
from kuberl.operator.builders.bus import render_nats_conf
from kuberl.operator.builders.bus_auth import OPERATOR, ROLLOUT, TRAINER, role_password
from kuberl.operator.progress import BusReader
from kuberl.runtime.bus import Bus, BusError
from kuberl.runtime.bus.messages import EvalResult, EvalTicket
from kuberl.runtime.bus.names import KEY_PROGRESS, KEY_WEIGHTS, RUN_ENV
from kuberl.runtime.bus.server import find_nats_server

TOKEN = "per-experiment-random-token"
EXP = RLExperiment.model_validate({
    "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
    "metadata": {"name": "gsm8k", "namespace": "team-a", "uid": "4f3a0c9e-12ab-4cde-8f00-0123456789ab"},
    "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}},
})
RUN = naming.bus_run(EXP)


def creds(role: str) -> dict[str, str]:
    return {"user": role, "password": role_password(TOKEN, role)}


@pytest.fixture
def users_bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """nats-server on the rendered config (only ports and paths moved to this machine)."""
    port, http = free_port("127.0.0.1"), free_port("127.0.0.1")
    conf = (render_nats_conf(EXP, TOKEN).replace("port: 4222", f"port: {port}").replace("http_port: 8222", f"http_port: {http}")
            .replace("/data/jetstream", str(tmp_path / "js")).replace("/var/run/nats", str(tmp_path)))
    (tmp_path / "nats.conf").write_text(conf)
    log = open(tmp_path / "nats.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([find_nats_server(), "-c", str(tmp_path / "nats.conf"), "--name", f"users-{uuid.uuid4().hex[:8]}"],
                            stdout=log, stderr=subprocess.STDOUT)
    monkeypatch.setenv(RUN_ENV, RUN)
    for var in ("KUBERL_BUS_TOKEN", "KUBERL_BUS_USER", "KUBERL_BUS_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    try:
        url = f"nats://127.0.0.1:{port}"
        asyncio.run(_wait_up(url))
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


async def _wait_up(url: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            nc = await nats.connect(url, **creds(TRAINER), connect_timeout=1, allow_reconnect=False, error_cb=_quiet)
            await nc.jetstream().account_info()
            await nc.close()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _quiet(exc: Exception) -> None:
    return None


def test_each_role_does_its_work_and_the_rollout_user_cannot_touch_weights_or_streams(users_bus: str, tmp_path: Path) -> None:
    async def go() -> None:
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        await trainer.reset_experiment()  # a fresh trainer's start: delete and re-create every object
        await trainer.reset_trainer_consumer()
        weights = tmp_path / "w1"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(b"\x01" * 70_000)
        prefix = await trainer.put_weights(1, weights)
        await trainer.put_state(KEY_WEIGHTS, {"version": 1, "mode": "bus", "object": prefix})
        await trainer.put_state(KEY_PROGRESS, {"step": 1, "total_steps": 10, "done": False})
        assert await trainer.publish_tickets([ticket("t-1")]) == 1
        await trainer.publish_eval_tickets([EvalTicket(eval_id="e-1", step=1, index=0, version=1, samples=1, greedy=False)])

        rollout = await Bus.connect(users_bus, "gsm8k", **creds(ROLLOUT), connect_timeout=5)
        assert (await rollout.get_state(KEY_WEIGHTS))["object"] == prefix
        await rollout.get_weights(prefix, tmp_path / "got")
        assert (tmp_path / "got" / "model.safetensors").read_bytes() == b"\x01" * 70_000
        watched = rollout.watch_state(KEY_WEIGHTS)
        assert (await asyncio.wait_for(watched.__anext__(), 10))["version"] == 1
        await watched.aclose()
        lease = await rollout.pull_ticket(timeout=5)
        assert lease is not None and lease.value.ticket_id == "t-1"
        await lease.in_progress()
        assert await rollout.publish_group(group(lease.value))
        await lease.ack()
        eval_lease = await rollout.pull_eval_ticket(timeout=5)
        assert eval_lease is not None
        await rollout.publish_eval_result(EvalResult(eval_id="e-1", step=1, index=0, version=1, rewards=[1.0], agent="agent-0"))
        await eval_lease.ack()
        got = await trainer.pull_groups(1, timeout=5)
        assert [g.value.group_id for g in got] == ["t-1"]
        await got[0].ack()
        assert [r.value.eval_id for r in await trainer.pull_eval_results(timeout=5)] == ["e-1"]

        # What the rollout user may not do: each a clear BusError, fast.
        assert "refused" in await refused(rollout.put_weights(2, weights))
        assert "refused" in await refused(rollout.put_state(KEY_WEIGHTS, {"version": 99, "mode": "bus", "object": "v99"}))
        assert "refused" in await refused(rollout.put_state(KEY_PROGRESS, {"step": 99, "done": True}))
        assert "refused" in await refused(rollout.delete_weights(prefix))
        assert "refused" in await refused(rollout.reset_experiment())
        assert "refused" in await refused(rollout.purge_eval())
        assert "refused" in await refused(rollout.publish_tickets([ticket("t-x")]))
        await rollout.close()

        # ... and the server really kept everything as the trainer left it.
        assert (await trainer.get_state(KEY_WEIGHTS))["version"] == 1
        assert (await trainer.get_state(KEY_PROGRESS))["step"] == 1
        assert await trainer.list_weights() == [prefix]
        assert (await trainer.stream_info())["tickets_pending"] == 0
        await trainer.close()

    asyncio.run(go())


def test_agents_that_start_before_the_trainer_create_what_is_missing_and_the_trainer_takes_over(users_bus: str, tmp_path: Path) -> None:
    async def go() -> None:
        rollout = await Bus.connect(users_bus, "gsm8k", **creds(ROLLOUT), connect_timeout=5)  # an empty server
        assert await rollout.get_state(KEY_WEIGHTS) is None
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        await trainer.reset_trainer_consumer()
        assert await trainer.publish_tickets([ticket("t-1")]) == 1
        lease = await rollout.pull_ticket(timeout=5)
        assert lease is not None and lease.value.ticket_id == "t-1"
        assert await rollout.publish_group(group(lease.value))
        await lease.ack()
        assert [g.value.group_id for g in await trainer.pull_groups(1, timeout=5)] == ["t-1"]
        await rollout.close()
        await trainer.close()

    asyncio.run(go())


def test_the_rollout_user_is_refused_by_the_server_itself_not_only_by_the_client(users_bus: str) -> None:
    async def go() -> None:
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        await trainer.put_state(KEY_WEIGHTS, {"version": 1})
        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        nc = await nats.connect(users_bus, **creds(ROLLOUT), error_cb=on_error)
        bucket = trainer.names.kv_bucket
        await nc.publish(f"$KV.{bucket}.{KEY_WEIGHTS}", json.dumps({"version": 666}).encode())
        await nc.publish(f"$JS.API.STREAM.DELETE.{trainer.names.traj_stream}", b"")
        await nc.publish(f"$O.{trainer.names.weights_bucket}.M.x", b"{}")
        await nc.flush()
        await asyncio.sleep(0.5)
        await nc.close()
        assert len(denied) == 3 and all("permissions violation for publish" in d.lower() for d in denied), denied
        assert (await trainer.get_state(KEY_WEIGHTS)) == {"version": 1}
        await trainer.js.stream_info(trainer.names.traj_stream)  # still there
        await trainer.close()

    asyncio.run(go())


def test_the_operator_user_reads_progress_and_asks_for_a_checkpoint_but_cannot_write_progress(users_bus: str) -> None:
    async def go() -> None:
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        await trainer.put_state(KEY_PROGRESS, {"step": 7, "total_steps": 10, "done": False})
        reader = BusReader(connect_timeout=5)
        operator = (OPERATOR, role_password(TOKEN, OPERATOR))
        assert (await reader.read(users_bus, operator, "gsm8k", run=RUN))["step"] == 7
        assert await reader.request_checkpoint(users_bus, operator, "gsm8k", "ckpt-1", run=RUN)
        assert (await trainer.get_state("control"))["checkpoint_request"] == "ckpt-1"
        # the rollout's or a wrong password is no way in for the operator's reads
        assert await BusReader(connect_timeout=2).read(users_bus, (OPERATOR, role_password(TOKEN, ROLLOUT)), "gsm8k", run=RUN) is None
        await reader.close()

        nc = await nats.connect(users_bus, user=OPERATOR, password=operator[1])
        kv = await nc.jetstream().key_value(trainer.names.kv_bucket)
        with pytest.raises(Exception):  # noqa: B017, PT011 - refused: no answer comes (a timeout)
            await kv.put(KEY_PROGRESS, b'{"step": 99, "done": true}')
        await nc.close()
        assert (await trainer.get_state(KEY_PROGRESS))["step"] == 7
        await trainer.close()

    asyncio.run(go())


def test_a_large_group_goes_in_chunks_under_the_rollout_user(users_bus: str) -> None:
    async def go() -> None:
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        await trainer.publish_tickets([ticket("t-big")])
        rollout = await Bus.connect(users_bus, "gsm8k", **creds(ROLLOUT), max_payload="8KB", connect_timeout=5)
        lease = await rollout.pull_ticket(timeout=5)
        big = group(lease.value)
        big.samples[0].input_ids = list(range(5000))
        assert await rollout.publish_group(big)  # chunks on <prefix>.traj.chunk, then the header message
        await lease.ack()
        got = await trainer.pull_groups(1, timeout=5)
        assert [g.value.samples[0].input_ids[-1] for g in got] == [4999]
        await rollout.close()
        await trainer.close()

    asyncio.run(go())


def test_the_operator_user_reads_the_metrics_stream_for_kuberl_plot(users_bus: str) -> None:
    from kuberl.runtime.bus.metrics import MetricsPublisher, read_rows

    async def go() -> None:
        trainer = await Bus.connect(users_bus, "gsm8k", **creds(TRAINER), connect_timeout=5)
        publisher = await MetricsPublisher.start(trainer, fresh=True)
        for step in (1, 2, 3):
            publisher.publish({"step": step, "reward": step / 10})
        await publisher.close()
        nc = await nats.connect(users_bus, user=OPERATOR, password=role_password(TOKEN, OPERATOR))
        rows = await read_rows(nc.jetstream(), trainer.names, timeout=10)
        assert [r["step"] for r in rows] == [1, 2, 3]
        await nc.close()
        await trainer.close()

    asyncio.run(go())


def test_a_wrong_password_is_an_authorization_error_naming_the_variables(users_bus: str) -> None:
    async def go() -> None:
        with pytest.raises(BusError, match="KUBERL_BUS_USER and KUBERL_BUS_PASSWORD"):
            await Bus.connect(users_bus, "gsm8k", user=ROLLOUT, password="wrong", connect_timeout=2)

    asyncio.run(go())
