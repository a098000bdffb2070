"""The trainer's side of the bus: a thin adapter over `kuberl.runtime.bus.Bus` (rank 0 only).

Says in one place which bus objects the trainer touches (contracts.md): tickets out, groups in
(acked after a checkpoint), KV `weights`/`policy_version`/`progress`/`tickets`/`control`, and the
weights object store in `bus` sync mode (`broadcast` mode: only the record; the tensors go over weight_sync's group).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kuberl.runtime.bus import Bus, Lease, Ticket, TrajectoryGroup
from kuberl.runtime.bus.names import KEY_CONTROL, KEY_POLICY_VERSION, KEY_PROGRESS, KEY_TICKETS, KEY_WEIGHTS

log = logging.getLogger(__name__)

BUS_WEIGHTS_KEEP = 3  # versions kept in the object store (agents may still be downloading the previous one)


class TrainerBusIO:
    def __init__(self, bus: Bus):
        self.bus = bus
        self.groups_buffered: int | None = None

    @classmethod
    async def connect(cls, url: str | None, experiment: str, *, token: str | None = None) -> TrainerBusIO:
        return cls(await Bus.connect(url, experiment, token=token, name=f"kuberl-{experiment}-trainer"))

    async def start(self, *, resumed: bool) -> None:
        """Take over the bus: a fresh start clears what an earlier run of the same name left (its ticket
        ids repeat and the streams would deduplicate them); a resumed trainer keeps everything and takes
        over the trainer consumer, so whatever it left unacked comes again now."""
        if not resumed:
            await self.bus.reset_experiment()
        await self.bus.reset_trainer_consumer()
        log.info("bus %s: trainer consumer reset (%s)", self.bus.url, "resumed from a checkpoint" if resumed else "fresh start")

    async def close(self) -> None:
        await self.bus.close()

    @property
    def connected(self) -> bool:
        """Whether the connection to nats-server is up (nats-py reconnects on its own while it is not)."""
        return bool(self.bus.nc.is_connected)

    async def publish_tickets(self, tickets: list[Ticket]) -> int:
        return await self.bus.publish_tickets(tickets)

    async def put_tickets(self, state: dict[str, Any]) -> None:
        await self.bus.put_state(KEY_TICKETS, {**state, "time": time.time()})

    async def get_tickets(self) -> dict[str, Any] | None:
        """The ticket book as the trainer last wrote it (before a crash, on a restart)."""
        return await self.bus.get_state(KEY_TICKETS)

    async def fetch_groups(self, max_n: int, timeout: float) -> list[tuple[TrajectoryGroup, Lease]]:
        return [(lease.value, lease) for lease in await self.bus.pull_groups(max_n, timeout=timeout)]

    async def ack(self, leases: list[Lease]) -> None:
        for lease in leases:
            await lease.ack()

    async def get_control(self) -> dict[str, Any]:
        return await self.bus.get_state(KEY_CONTROL) or {}

    async def publish_weights(self, version: int, path: Path | None, *, mode: str, record: dict[str, Any] | None = None) -> None:
        """Make version `version` (already written to `path`) the one agents load, then bump policy_version.

        broadcast: no path; `record` (rendezvous, session, backend: weight_sync.sender) tells agents where to ask for the tensors."""
        obj = None
        if mode == "broadcast":
            if not record or "rendezvous" not in record or "session" not in record:
                raise ValueError(f"weightSync.mode broadcast: the weights record needs rendezvous and session, got {record!r}")
            now = time.time()
            await self.bus.put_state(KEY_WEIGHTS, {"version": version, "mode": mode, "path": None, "object": None, **record, "time": now})
            await self.bus.put_state(KEY_POLICY_VERSION, {"version": version})
            return
        if mode == "bus":
            obj = await self.bus.put_weights(version, path)
            for prefix in await self.bus.list_weights():
                # Keep the newest few (by number); a republished older version is kept as the current one.
                old = prefix.startswith("v") and prefix[1:].isdigit() and prefix != obj
                if old and not version - BUS_WEIGHTS_KEEP < int(prefix[1:]) <= version:
                    await self.bus.delete_weights(prefix)
        elif mode != "disk":
            raise ValueError(f"weightSync.mode: {mode!r} is not disk, bus or broadcast")
        now = time.time()
        await self.bus.put_state(KEY_WEIGHTS, {"version": version, "mode": mode, "path": str(path) if mode == "disk" else None,
                                               "object": obj, "time": now})
        await self.bus.put_state(KEY_POLICY_VERSION, {"version": version})

    async def put_progress(self, progress: dict[str, Any]) -> None:
        await self.bus.put_state(KEY_PROGRESS, progress)

    async def refresh_buffered(self, local: int) -> None:
        """Groups ready for the trainer: on the stream and not yet pulled, plus those pulled but not trained."""
        try:
            info = await self.bus.stream_info()
            self.groups_buffered = int(info["groups_waiting"]) + local
        except Exception as exc:  # an observation only: never fail a step for it
            log.debug("stream info unavailable: %s", exc)
