"""The rollout agent's probe endpoints, on a port of their own: GET /healthz (liveness), GET /readyz (readiness),
and GET /metrics (Prometheus text: the agent's counters, read at scrape time; kuberl.runtime.prom.AgentCollector).

Kubelet probes come from the node, so in a pod the server listens on every address ($KUBERL_AGENT_HEALTH_PORT,
set by the rollout StatefulSet); `kuberl run` leaves the variable unset and starts none. 200 "ok" or
503 with the reason. It serves from the agent's own event loop, so a blocked loop fails both probes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kuberl.runtime.prom import agent_registry

log = logging.getLogger(__name__)

HEALTH_PORT_ENV = "KUBERL_AGENT_HEALTH_PORT"
# Liveness fails when the agent made no progress (a ticket taken or finished, weights loaded, a poll of
# a lost engine) for this long: every slot held by an episode that never returns.
STALL_SECONDS = 1800.0


class AgentHealth:
    """What the probes read. main.py fills in bus, engine and agent as they come up."""

    def __init__(self, *, stall_seconds: float = STALL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.bus: Any = None  # kuberl.runtime.bus.Bus (its nats client: .nc.is_connected)
        self.engine: Any = None  # an InferenceEngine (async health())
        self.agent: Any = None  # a RolloutAgent (last_progress, engine_down)
        self.stall_seconds = stall_seconds
        self.clock = clock

    def live(self) -> tuple[bool, str]:
        """Alive unless the agent's loop has stalled (waiting on a lost engine counts as progress: the
        agent gives up on it by itself after ENGINE_WAIT_SECONDS and exits)."""
        if self.agent is None:
            return True, "starting"
        idle = self.clock() - self.agent.last_progress
        if idle > self.stall_seconds:
            # workflow.external: slots held by episodes that wait for agents elsewhere are not a stall a restart would cure
            # (the episodes' own timeouts end them); episode_api.ExternalAgentWorkflow.waiting says so.
            waiting = getattr(getattr(self.agent, "workflow", None), "waiting", None)
            if callable(waiting) and (why := waiting()):
                return True, why
            return False, f"no progress for {idle:.0f} s (limit {self.stall_seconds:.0f} s)"
        return True, "ok"

    async def ready(self) -> tuple[bool, str]:
        """Ready when connected to the bus and its engine answers."""
        if self.bus is None or self.engine is None or self.agent is None:
            return False, "starting"
        if not self.bus.nc.is_connected:
            return False, "not connected to the bus"
        if self.agent.engine_down:
            return False, "engine lost; waiting for it to restart"
        if not await self.engine.health():
            return False, "engine not answering its health check"
        return True, "ok"


def health_app(state: AgentHealth) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        ok, why = state.live()
        return web.Response(status=200 if ok else 503, text=why)

    async def readyz(_: web.Request) -> web.Response:
        ok, why = await state.ready()
        return web.Response(status=200 if ok else 503, text=why)

    registry = agent_registry(lambda: state.agent)

    async def metrics(_: web.Request) -> web.Response:
        # Read in the agent's own loop: the counters are consistent with each other, and cheap to read.
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


async def start_health_server(state: AgentHealth, port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """Serve the probes on host:port (port 0: a free one); the caller cleans up the returned runner."""
    runner = web.AppRunner(health_app(state), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("probe endpoints on %s:%d (/healthz, /readyz, /metrics)", host, port)
    return runner


def health_port() -> int | None:
    value = os.environ.get(HEALTH_PORT_ENV)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${HEALTH_PORT_ENV} must be a port number, got {value!r}") from None
