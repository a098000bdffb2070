"""The bus retry loop's give-up rule (kuberl.runtime.bus.outage): a try sent before the connection came back
never counts against the call, and a try sent after it does. Seen in a full run: an ack sent while the server
was down timed out (its request had gone out on the old connection) just after the reconnect, and the call
gave up without ever trying on the new connection."""

from __future__ import annotations

import asyncio
import time

import pytest

from kuberl.runtime.bus.errors import BusError
from kuberl.runtime.bus.outage import Outage, retry


class _Conn:
    is_connected, is_closed = True, False


def test_a_try_lost_with_the_old_connection_is_tried_again_on_the_new_one() -> None:
    outage = Outage(_Conn(), publish_timeout=0.3, outage=30.0)
    tries: list[float] = []

    async def ack() -> str:
        tries.append(time.monotonic())
        if len(tries) == 1:  # sent before the reconnect; the connection comes back meanwhile; nobody answers
            await asyncio.sleep(0.1)
            outage.on_reconnect()
            await asyncio.sleep(0.4)
            raise TimeoutError
        return "acked"

    assert asyncio.run(retry(outage, "nats://b", "ack t0", ack)) == "acked"
    assert len(tries) == 2 and tries[1] > outage.back_at


def test_a_try_sent_after_the_reconnect_still_gives_up_after_publish_timeout() -> None:
    outage = Outage(_Conn(), publish_timeout=0.3, outage=30.0)
    tries: list[float] = []

    async def ack() -> None:
        tries.append(time.monotonic())
        await asyncio.sleep(0.4)
        raise TimeoutError

    outage.on_reconnect()  # back just before the call: its first try goes out on the new connection
    t0 = time.monotonic()
    with pytest.raises(BusError, match="not answering for 0s"):
        asyncio.run(retry(outage, "nats://b", "ack t0", ack))
    assert len(tries) == 1 and time.monotonic() - t0 < 2.0  # the outage cap (30 s) is not what ended it


def test_a_lost_try_does_not_outlive_the_outage_cap() -> None:
    outage = Outage(_Conn(), publish_timeout=0.1, outage=0.6)

    async def ack() -> None:  # every try is lost with a connection that keeps coming back
        await asyncio.sleep(0.05)
        outage.on_reconnect()
        await asyncio.sleep(0.15)
        raise TimeoutError

    t0 = time.monotonic()
    with pytest.raises(BusError):
        asyncio.run(retry(outage, "nats://b", "ack t0", ack))
    assert 0.5 < time.monotonic() - t0 < 3.0
