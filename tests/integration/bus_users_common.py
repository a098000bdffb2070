"""What the two bus-user tests share (test_bus_users: the embedded bus's users; test_shared_nats_users: users
minted on a shared NATS): a ticket, a group answering it, and the check that a refused call fails fast."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kuberl.runtime.bus import BusError
from kuberl.runtime.bus.messages import Sample, Ticket, TrajectoryGroup

REFUSAL_SECONDS = 12  # a refused request is never answered: the Bus says so after its first timeout


def ticket(ticket_id: str) -> Ticket:
    return Ticket(ticket_id=ticket_id, index=0, epoch=0, issued_version=1)


def group(t: Ticket) -> TrajectoryGroup:
    sample = Sample(input_ids=[1, 2], output_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[1, 1], loss_mask=[1, 1], reward=1.0)
    return TrajectoryGroup(group_id=t.ticket_id, ticket=t, samples=[sample], agent="agent-0")


async def refused(call: Any) -> str:
    t0 = time.monotonic()
    with pytest.raises(BusError) as err:
        await call
    assert time.monotonic() - t0 < REFUSAL_SECONDS, "a refused call must fail fast, not hang"
    return str(err.value)
