"""Make a client call drop cancels, as Python 3.11's asyncio.wait_for does inside nats-py (kuberl/runtime/aio.py)."""

from __future__ import annotations

import asyncio

import pytest


def drop_cancels(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, *, until_result: bool = False) -> None:
    """A cancel of a task awaiting `cls.name` lets the call finish and returns its result (or its error): the cancel is gone.

    That is 3.11's wait_for when the awaited message and the cancel arrive in the same loop turn; here it happens on
    every cancel, so a test fails each time the code under test ignores `Task.cancelling()`. `until_result`: after the
    dropped cancel the call is repeated until it returns something other than None (a pull that gets the next message).
    """
    original = getattr(cls, name)

    async def dropping(self, *args, **kwargs):
        inner = asyncio.ensure_future(original(self, *args, **kwargs))
        try:
            return await asyncio.shield(inner)
        except asyncio.CancelledError:
            result = await inner
            while until_result and result is None:
                result = await original(self, *args, **kwargs)
            return result

    monkeypatch.setattr(cls, name, dropping)
