"""The engine API key: every engine endpoint but the probes' needs `Authorization: Bearer <key>`.

vLLM's own --api-key / $VLLM_API_KEY guards only /v1, /v2, /inference and /cohere (vLLM 0.32,
entrypoints/serve/middleware/authenticate.py), not the development endpoints KubeRL turns on (/pause,
/resume, /collective_rpc, /reset_prefix_cache, /abort_requests). EngineAuthMiddleware, passed to the
server with `--middleware`, guards every path except OPEN_PATHS. The key comes from $KUBERL_ENGINE_API_KEY
(a secretKeyRef in pods), never from the command line (which is logged and readable in /proc).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

API_KEY_ENV = "KUBERL_ENGINE_API_KEY"
MIDDLEWARE = "kuberl.runtime.inference.engine_auth.EngineAuthMiddleware"
# Kubelet probes (the engine container's startup/readiness/liveness probes) carry no key.
OPEN_PATHS = frozenset({"/health", "/ping"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def engine_api_key() -> str | None:
    """The key this process's engine server or client uses ($KUBERL_ENGINE_API_KEY), None when unset."""
    return os.environ.get(API_KEY_ENV) or None


def redact_command(cmd: list[str]) -> str:
    """The command line for a log: the value after --api-key (SGLang's) as ***."""
    return " ".join("***" if i and cmd[i - 1] == "--api-key" else arg for i, arg in enumerate(cmd))


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


class EngineAuthMiddleware:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(cls)`): 401 unless the bearer token
    is the key, on every HTTP/websocket path outside OPEN_PATHS."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        key = key or engine_api_key()
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs ${API_KEY_ENV}")
        self.app = app
        self._key = _digest(key)

    def allowed(self, scope: Scope) -> bool:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return True
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS:
            return True
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._key)

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": "Unauthorized: this engine needs Authorization: Bearer <key>"}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
