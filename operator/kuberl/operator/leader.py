"""Leader election by a coordination.k8s.io/v1 Lease, the way controller-runtime and kube-scheduler elect theirs.

`kuberl operator --leader-election` (the chart sets it with replicaCount > 1): each replica waits for the Lease
`kuberl-operator` in its own namespace before it starts kopf; the leader renews it every RETRY_PERIOD seconds and
exits (the Deployment restarts it as a standby) when it cannot renew for RENEW_DEADLINE; a standby takes a Lease its
holder has not renewed for leaseDurationSeconds, measured on its own clock from when it last saw the record change
(client-go's rule: no trust in other machines' clocks). A leader that stops cleanly (SIGTERM: a rollout, a drained
node) releases the Lease, and a standby takes over within RETRY_PERIOD. kopf's own peering, which this replaces for
several replicas, lets a standby take over only once the dead peer's record is a minute old.

Writes go through optimistic concurrency (the Lease's resourceVersion): of two replicas racing, one gets 409 Conflict
and stays a standby. The chart grants get/create/update on this one Lease name in the operator's namespace only.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kuberl.operator.kube import KubeClient, KubeError, path_for

log = logging.getLogger("kuberl.operator.leader")
LEASE_NAME = "kuberl-operator"
LEASE_SECONDS, RENEW_DEADLINE, RETRY_PERIOD = 15, 10, 2  # client-go's defaults for kube-scheduler / controller-manager


class LeadershipLost(Exception):
    """The leader could not renew its Lease within the renew deadline: another replica may lead now."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Elector:
    """One replica's view of the Lease. `acquire()` returns once it leads; `keep()` renews until the deadline is
    missed (raises LeadershipLost); `release()` hands the Lease over on a clean stop."""

    kube: KubeClient
    namespace: str
    identity: str
    name: str = LEASE_NAME
    lease_seconds: int = LEASE_SECONDS
    renew_deadline: float = RENEW_DEADLINE
    retry: float = RETRY_PERIOD
    _observed: tuple[Any, ...] = field(default=(), repr=False)
    _observed_at: float = field(default=0.0, repr=False)

    def _path(self, named: bool = True) -> str:
        return path_for("Lease", self.namespace, self.name if named else None)

    def _spec(self, old: dict[str, Any], now: str) -> dict[str, Any]:
        """The spec this replica writes: itself as holder, renewed now (acquired now, one more transition, if it was not)."""
        taking = old.get("holderIdentity") != self.identity
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds, "renewTime": now,
                "acquireTime": now if taking else old.get("acquireTime", now),
                "leaseTransitions": int(old.get("leaseTransitions") or 0) + (1 if taking and old.get("holderIdentity") else 0)}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this replica holds the Lease afterwards."""
        now = _now()
        try:
            lease = await self.kube.request("GET", self._path())
        except KubeError as exc:
            if exc.status != 404:
                raise
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec({}, now)}
            try:
                await self.kube.request("POST", self._path(named=False), body=body)
                return True
            except KubeError as race:
                if race.status == 409:
                    return False
                raise
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            return False  # held, and renewed within its duration as far as this replica has seen
        lease["spec"] = self._spec(spec, now)
        try:
            await self.kube.request("PUT", self._path(), body=lease)  # carries metadata.resourceVersion: 409 if it moved
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        if holder != self.identity:
            log.info("leader election: %s took Lease %s/%s from %s", self.identity, self.namespace, self.name, holder or "nobody")
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads (a standby polls every `retry` seconds)."""
        log.info("leader election: %s waiting for Lease %s/%s", self.identity, self.namespace, self.name)
        while True:
            try:
                if await self.try_acquire_or_renew():
                    return
            except (TimeoutError, KubeError, OSError) as exc:
                log.warning("leader election: %s", exc)
            await asyncio.sleep(self.retry)

    async def keep(self) -> None:
        """Renew every `retry` seconds; raise LeadershipLost once `renew_deadline` passes without a renewal."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.retry)
            try:
                if await self.try_acquire_or_renew():
                    renewed = time.monotonic()
                    continue
            except (TimeoutError, KubeError, OSError) as exc:
                log.warning("leader election: renewing: %s", exc)
            if time.monotonic() - renewed > self.renew_deadline:
                raise LeadershipLost(f"{self.identity} could not renew Lease {self.namespace}/{self.name} for {self.renew_deadline:.0f} s")

    async def release(self) -> None:
        """Give the Lease up (a clean stop): a standby takes it at its next attempt instead of after the duration."""
        try:
            lease = await self.kube.request("GET", self._path())
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
            await self.kube.request("PUT", self._path(), body=lease)
            log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except (TimeoutError, KubeError, OSError) as exc:
            log.warning("leader election: releasing: %s", exc)


async def lead(elector: Elector, work: Any) -> None:
    """Run the coroutine `work` (kopf's operator) while this replica leads: it starts once the Lease is held, and is
    cancelled if the Lease is lost (then LeadershipLost propagates: the process exits and restarts as a standby). The
    Lease is released when `work` ends or is cancelled (SIGTERM)."""
    await elector.acquire()
    keeper = asyncio.ensure_future(elector.keep())
    runner = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({keeper, runner}, return_when=asyncio.FIRST_COMPLETED)
        if keeper in done:
            runner.cancel()
            keeper.result()  # raises LeadershipLost
        runner.result()
    finally:
        keeper.cancel()
        runner.cancel()
        await elector.release()
