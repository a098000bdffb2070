"""The rollout agent's probe endpoints: /healthz (liveness) and /readyz (readiness) answer from its state.

A real aiohttp server on a free loopback port, with fake bus/engine/agent objects standing in for the
state the probes read; the agent's own bookkeeping (last_progress, engine_down) is tested on a RolloutAgent.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest

from kuberl.runtime.rollout.health import HEALTH_PORT_ENV, AgentHealth, health_port, start_health_server


class FakeEngine:
    def __init__(self) -> None:
        self.healthy = True

    async def health(self) -> bool:
        return self.healthy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def probe(port: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}") as resp:
        return resp.status, await resp.text()


async def test_probes_follow_the_agent_state() -> None:
    clock = Clock()
    state = AgentHealth(stall_seconds=60, clock=clock)
    runner = await start_health_server(state, 0, host="127.0.0.1")
    port = runner.addresses[0][1]
    try:
        # Starting: alive (kubelet must not kill a loading agent), not ready.
        assert await probe(port, "/healthz") == (200, "starting")
        assert await probe(port, "/readyz") == (503, "starting")

        nc = SimpleNamespace(is_connected=True)
        engine = FakeEngine()
        agent = SimpleNamespace(last_progress=clock.now, engine_down=False)
        state.bus, state.engine, state.agent = SimpleNamespace(nc=nc), engine, agent
        assert await probe(port, "/healthz") == (200, "ok")
        assert await probe(port, "/readyz") == (200, "ok")

        nc.is_connected = False
        status, why = await probe(port, "/readyz")
        assert (status, "bus" in why) == (503, True)
        assert (await probe(port, "/healthz"))[0] == 200  # a bus outage is not a reason to restart
        nc.is_connected = True

        engine.healthy = False
        status, why = await probe(port, "/readyz")
        assert (status, "engine not answering" in why) == (503, True)
        agent.engine_down = True
        status, why = await probe(port, "/readyz")
        assert (status, "engine lost" in why) == (503, True)
        assert (await probe(port, "/healthz"))[0] == 200  # waiting for a lost engine is alive
        engine.healthy, agent.engine_down = True, False

        clock.now += 59
        assert (await probe(port, "/healthz"))[0] == 200
        clock.now += 2  # past the stall limit with no progress
        status, why = await probe(port, "/healthz")
        assert (status, "no progress for 61 s" in why) == (503, True)
        agent.last_progress = clock.now
        assert (await probe(port, "/healthz"))[0] == 200
        assert (await probe(port, "/nope"))[0] == 404  # nothing else is served
    finally:
        await runner.cleanup()


def test_health_port_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(HEALTH_PORT_ENV, raising=False)
    assert health_port() is None  # kuberl run: no probe server
    monkeypatch.setenv(HEALTH_PORT_ENV, "8001")
    assert health_port() == 8001
    monkeypatch.setenv(HEALTH_PORT_ENV, "http")
    with pytest.raises(ValueError, match=HEALTH_PORT_ENV):
        health_port()
