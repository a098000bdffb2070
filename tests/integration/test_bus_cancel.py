"""A cancelled bus call ends cancelled, also when the nats client drops the cancel (kuberl/runtime/aio.py).

On Python 3.11, nats-py waits for messages with asyncio.wait_for, which returns a message that arrives
in the same loop turn as a `task.cancel()` and drops the cancel. A rollout agent stopped that way ran
on (CI, 2026-11-28: `test_a_stopped_agent_gives_its_tickets_back_at_once` hung for 600 s). The first
tests make the client drop every cancel, so they fail whenever the bus ignores `Task.cancelling()`;
the last one races real cancels against real deliveries, unpatched.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from dropped_cancels import drop_cancels
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from kuberl.runtime.bus import Bus, Ticket

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def ticket(i: int) -> Ticket:
    return Ticket(ticket_id=f"e0-i{i}-{i}", index=i, epoch=0, issued_version=0)


@pytest_asyncio.fixture(loop_scope="function")
async def bus(nats_server, experiment_name):
    b = await Bus.connect(nats_server.url, experiment_name)  # ack_wait 30 s: a quick redelivery means a nak
    yield b
    await b.close()


async def ends_cancelled(task: asyncio.Task, within: float = 5.0) -> None:
    done, _ = await asyncio.wait({task}, timeout=within)
    assert task in done, f"a cancelled task still runs after {within} s"
    assert task.cancelled(), f"a cancelled task returned {task.result()!r}"


async def test_a_pull_whose_cancel_the_client_drops_ends_cancelled_and_gives_the_ticket_back(bus, monkeypatch):
    drop_cancels(monkeypatch, JetStreamContext.PullSubscription, "fetch")
    pull = asyncio.create_task(bus.pull_ticket(timeout=10.0))
    await asyncio.sleep(0.3)  # the pull request waits on the server
    pull.cancel()
    await bus.publish_tickets([ticket(0)])  # delivered to the cancelled pull, which the client lets finish
    await ends_cancelled(pull)
    again = await bus.pull_ticket(timeout=5.0)  # long before the 30 s ack_wait: it was given back
    assert again is not None and again.value.ticket_id == "e0-i0-0" and again.delivered == 2
    await again.ack()


async def test_a_pull_whose_cancel_the_client_drops_ends_cancelled_when_nothing_comes(bus, monkeypatch):
    drop_cancels(monkeypatch, JetStreamContext.PullSubscription, "fetch")
    pull = asyncio.create_task(bus.pull_ticket(timeout=1.0))
    await asyncio.sleep(0.3)
    pull.cancel()
    await ends_cancelled(pull)


async def test_a_state_watch_whose_cancel_the_client_drops_ends_cancelled(bus, monkeypatch):
    drop_cancels(monkeypatch, KeyValue.KeyWatcher, "updates")
    await bus.put_state("weights", {"version": 1})
    seen = []

    async def watch():
        async for value in bus.watch_state("weights"):
            seen.append(value["version"])
            if value["version"] == 2:
                return  # the watch ran on past its cancel (and ends here, so that a failing test does not hang)

    task = asyncio.create_task(watch())
    while not seen:
        await asyncio.sleep(0.01)
    task.cancel()
    await bus.put_state("weights", {"version": 2})  # an update lands on the cancelled watch
    await ends_cancelled(task)
    assert seen == [1]


async def test_real_cancels_racing_real_deliveries_all_end_cancelled(bus):
    """Unpatched: on 3.11 a few in a thousand cancels that land as the ticket arrives are dropped by the client."""
    cancelled = returned = stranded = 0
    for i in range(1500):
        pull = asyncio.create_task(bus.pull_ticket(timeout=5.0))
        await asyncio.sleep(0.002)  # the pull request waits on the server
        publish = asyncio.create_task(bus.publish_tickets([ticket(i)]))
        for _ in range(i % 12):  # spread the cancel around the delivery, a loop turn at a time
            await asyncio.sleep(0)
        taken = not pull.cancel()  # True: it had its ticket already
        await publish
        if not taken:
            cancelled += 1
            await asyncio.wait({pull}, timeout=5.0)
            if not pull.cancelled():
                returned += 1
            taken = pull.done() and not pull.cancelled() and pull.exception() is None
        lease = pull.result() if taken else await bus.pull_ticket(timeout=0.5)  # given back, or still in the inbox
        if lease is None:
            stranded += 1
        else:
            await lease.ack()
    print(f"{cancelled} cancelled pulls, {returned} ran on, {stranded} tickets left in a cancelled fetch (ack_wait redelivers)")
    assert cancelled > 300, f"only {cancelled} cancels landed during a pull: the race was not exercised"
    assert returned == 0, f"{returned} of {cancelled} cancelled pulls ran on"
