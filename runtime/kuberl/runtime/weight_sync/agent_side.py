"""The rollout agent's side of `weightSync.mode: broadcast`: ask the trainer, pause, receive, resume (broadcast.py's docstring).

Generation goes on while the agent waits for its assignment; the engine is paused only for the receive. A receive
that fails (the trainer's timeout, a member lost mid-broadcast) may leave a mix of versions in the engine, so the
engine stays paused and the agent asks again until one completes; only an engine that stopped answering ends it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.inference.base import EngineError
from kuberl.runtime.weight_sync.broadcast import file_request, wait_assignment

log = logging.getLogger(__name__)

ASSIGN_POLL_SECONDS = 5.0  # between looks at the `weights` record while waiting (a restarted trainer has a new session)
RETRY_SECONDS = 1.0


async def _assignment(agent: Any, record: dict[str, Any]) -> dict[str, Any]:
    """File a request with the trainer of `record` and wait for it to be served (following a restarted trainer)."""
    workers = int(getattr(agent.engine, "workers", 1))
    while True:
        try:
            i = await asyncio.to_thread(file_request, record, agent.agent_id, workers)
        except Exception as exc:  # noqa: BLE001  the trainer is (re)starting: its next record says where it is
            log.warning("agent %s: cannot reach the trainer at %s for weights (%s); retrying", agent.agent_id, record.get("rendezvous"), exc)
            await asyncio.sleep(2.0)
            record = await agent.bus.get_state(KEY_WEIGHTS) or record
            continue
        while True:
            try:
                assign = await asyncio.to_thread(wait_assignment, record, i, ASSIGN_POLL_SECONDS)
            except Exception as exc:  # noqa: BLE001  its trainer is gone: wait for the record of the next one
                log.warning("agent %s: lost the trainer at %s while waiting for weights (%s)", agent.agent_id, record.get("rendezvous"), exc)
                assign = None
                await asyncio.sleep(1.0)
            agent._progressed()
            if assign is not None:
                return assign
            current = await agent.bus.get_state(KEY_WEIGHTS)
            if current is not None and current.get("session") != record.get("session"):
                record = current  # a restarted trainer: the old one will never answer
                break
            if current is not None and current.get("mode") != "broadcast":
                raise RuntimeError(f"weightSync.mode changed to {current.get('mode')!r} while waiting for a broadcast")


async def receive_broadcast(agent: Any, record: dict[str, Any]) -> int:
    """Get the trainer's current weights into the agent's engine; returns the version received."""
    engine = agent.engine
    paused = False
    try:
        while True:
            assign = await _assignment(agent, record)
            if not paused:
                await engine.pause()
                paused = True
            try:
                await engine.update_weights_broadcast(assign)
                return int(assign["version"])
            except EngineError as exc:
                if not await engine.health():
                    raise
                log.warning("agent %s: weight broadcast %s failed (%s); the engine stays paused and asks again",
                            agent.agent_id, assign.get("update"), exc)
                await asyncio.sleep(RETRY_SECONDS)
                record = await agent.bus.get_state(KEY_WEIGHTS) or record
    finally:
        if paused:
            await engine.resume()
