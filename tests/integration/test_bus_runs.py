"""A shared external NATS: experiments of the same name in two namespaces, and an experiment deleted
and re-created under its old name, never share a bus object (issue 11, B6). Real nats-server; the
run comes to the roles as $KUBERL_BUS_RUN (the operator sets it from namespace and uid) and the
operator reads progress with the same run (kuberl.operator.progress)."""

from __future__ import annotations

import pytest

from kuberl.operator.progress import BusReader
from kuberl.runtime.bus import Bus
from kuberl.runtime.bus.names import RUN_ENV

pytestmark = pytest.mark.integration

TEAM_A, TEAM_B = "team-a.0a1b2c3d4e5f", "team-b.0a1b2c3d4e5f"


async def connect(url: str, name: str, run: str, monkeypatch: pytest.MonkeyPatch) -> Bus:
    """A role's connection in a pod of this run (env as the operator renders it)."""
    monkeypatch.setenv(RUN_ENV, run)
    try:
        return await Bus.connect(url, name)
    finally:
        monkeypatch.delenv(RUN_ENV)


async def test_a_fresh_trainers_reset_leaves_the_other_namespaces_experiment_alone(nats_server, experiment_name, monkeypatch) -> None:
    a = await connect(nats_server.url, experiment_name, TEAM_A, monkeypatch)
    b = await connect(nats_server.url, experiment_name, TEAM_B, monkeypatch)
    try:
        await a.put_state("progress", {"step": 7, "done": False})
        await b.put_state("progress", {"step": 0, "done": False})
        await b.reset_experiment()  # team-b's trainer starts from scratch
        assert await a.get_state("progress") == {"step": 7, "done": False}
        assert await b.get_state("progress") is None
    finally:
        await a.close()
        await b.close()


async def test_a_recreated_experiment_never_reads_the_old_runs_progress(nats_server, experiment_name, monkeypatch) -> None:
    old_run, new_run = "team-a.111111111111", "team-a.222222222222"  # same namespace and name, a new uid
    old = await connect(nats_server.url, experiment_name, old_run, monkeypatch)
    reader = BusReader()
    try:
        await old.put_state("progress", {"step": 100, "done": True})
        assert (await reader.read(nats_server.url, None, experiment_name, run=old_run))["done"] is True
        assert await reader.read(nats_server.url, None, experiment_name, run=new_run) is None
        new = await connect(nats_server.url, experiment_name, new_run, monkeypatch)
        try:
            await new.put_state("progress", {"step": 1, "done": False})
            assert await reader.read(nats_server.url, None, experiment_name, run=new_run) == {"step": 1, "done": False}
        finally:
            await new.close()
    finally:
        await old.close()
        await reader.close()


async def test_the_operator_reads_the_bucket_the_roles_write(nats_server, experiment_name, monkeypatch) -> None:
    bus = await connect(nats_server.url, experiment_name, TEAM_A, monkeypatch)
    reader = BusReader()
    try:
        await bus.put_state("progress", {"step": 3})
        assert await reader.read(nats_server.url, None, experiment_name, run=TEAM_A) == {"step": 3}
        assert await reader.read(nats_server.url, None, experiment_name) is None  # the plain, run-less names
    finally:
        await bus.close()
        await reader.close()


async def test_an_agent_binding_while_the_trainers_fresh_start_deletes_the_streams_binds_again(nats_server, experiment_name, monkeypatch) -> None:
    """The race a CI run hit: the agent found the tickets stream, the trainer's reset_experiment deleted it, and the agent's
    consumer creation failed with "stream not found" (the agent exited 1 and was restarted). Now it binds again."""
    from nats.js.client import JetStreamContext

    from kuberl.runtime.bus.names import AGENTS_CONSUMER

    trainer = await connect(nats_server.url, experiment_name, TEAM_A, monkeypatch)
    original, deleted = JetStreamContext.consumer_info, []

    async def consumer_info(js, stream, consumer, *args, **kwargs):
        if consumer == AGENTS_CONSUMER and not deleted:  # the agent checks its consumer: the trainer's reset deletes the stream
            deleted.append(stream)
            await trainer.js.delete_stream(stream)
        return await original(js, stream, consumer, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext, "consumer_info", consumer_info)
    try:
        agent = await connect(nats_server.url, experiment_name, TEAM_A, monkeypatch)
        try:
            assert deleted, "the agent never checked its consumer"
            info = await original(agent.js, deleted[0], AGENTS_CONSUMER)
            assert info.config.durable_name == AGENTS_CONSUMER
        finally:
            await agent.close()
    finally:
        await trainer.close()
