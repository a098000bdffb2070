"""`run(coro)` for operator unit tests: asyncio.run, then close the operator's Kubernetes client, whose
aiohttp session belongs to that event loop (the next test runs another one)."""

from __future__ import annotations

import asyncio
from typing import Any

from kuberl.operator import lifecycle


def run(coro: Any) -> Any:
    async def with_fresh_session() -> Any:
        try:
            return await coro
        finally:
            await lifecycle.CONFIG.kube.close()  # the aiohttp session belongs to this event loop
    return asyncio.run(with_fresh_session())
