"""HTTPServerEngine: what the vLLM and SGLang engines share, a server process reached over HTTP.

Subclassed by vllm.VLLMEngine and sglang.SGLangEngine, which add only what differs: the server
command line and environment, endpoints, and request/response shaping. It launches the server (or
attaches to one by URL), waits until it is healthy, stops it, and runs the generation gate that
keeps every result on one weights version. The rollout agent reaches it through base.engine_class.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import ClassVar, Self

import aiohttp

from kuberl.net import reserve_port
from kuberl.runtime.inference.base import EngineError, GenerateRequest, GenerateResult
from kuberl.runtime.inference.engine_auth import auth_headers, engine_api_key, redact_command

log = logging.getLogger(__name__)
# Idle connections to the engine close after this, before the server's keep-alive (uvicorn's and vLLM's: 5 s) closes
# them: a request sent on a connection the server is closing at that moment fails with "Server disconnected" (a /pause
# of a weight update, 2026-12-03).
IDLE_CONNECTION_SECONDS = 2.0


class HTTPServerEngine:
    """An InferenceEngine over an HTTP inference server: launched here (model_path) or attached to (url).

    Subclasses set the class attributes below and implement server_command, request_payload,
    parse_response, _read_body, _pause_server, _abort_requests and _resume_server (plus weight updates).
    """

    name: ClassVar[str]
    """The server's name in logs and errors ("vLLM", "SGLang")."""
    health_path: ClassVar[str]
    health_timeout: ClassVar[float]
    """Seconds one health check may take."""
    health_poll_s: ClassVar[float]
    """Seconds between health checks while the server starts."""
    stop_grace_s: ClassVar[float]
    """Seconds stop() waits after SIGTERM before SIGKILL."""
    generate_path: ClassVar[str]
    pause_path: ClassVar[str]
    drain_polls: ClassVar[int]
    drain_poll_s: ClassVar[float]
    """pause() re-sends the abort, then checks up to drain_polls times, drain_poll_s apart, that every generation came back."""

    def __init__(
        self,
        model_path: str | None,
        *,
        url: str | None,
        host: str,
        port: int | None,
        startup_timeout: float,
        log_path: str | Path | None,
        version: int,
        request_timeout: float,
        api_key: str | None = None,
        **launch: object,
    ) -> None:
        """`launch`: the rest of build_server_command's keyword arguments (dtype, max_model_len, ...).
        `api_key` (default $KUBERL_ENGINE_API_KEY): sent as `Authorization: Bearer` on every request."""
        if (model_path is None) == (url is None):
            raise ValueError(f"{type(self).__name__} needs exactly one of model_path (launch a server) or url (attach to one)")
        self.model_path = model_path
        # A port of our choosing is held until stop() (kuberl.net.reserve_port): the server binds it only after
        # seconds of imports, and another process could take a port that was merely free when we looked.
        self._held = reserve_port(host) if port is None and url is None else None
        self.port = port or (self._held.getsockname()[1] if self._held else None)
        self.url = (url or f"http://{host}:{self.port}").rstrip("/")
        self._launch = {"host": host, **launch}
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.request_timeout = request_timeout
        self.proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._headers = auth_headers(api_key or engine_api_key())
        self._version = version
        # Generations start only while the gate is open; an update closes it, so every result's tokens
        # come from the one version current when it was submitted (see pause).
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight = 0

    # -- what each server does its own way -----------------------------------------------------

    def server_command(self) -> list[str]:
        """The command line that launches this engine's server for model_path on port."""
        raise NotImplementedError

    def server_env(self) -> dict[str, str] | None:
        """The server's environment; None inherits this process's."""
        return None

    @staticmethod
    def request_payload(req: GenerateRequest) -> dict:
        """The generate_path body for a token-ids request."""
        raise NotImplementedError

    @staticmethod
    def parse_response(body: dict | list, version: int) -> GenerateResult:
        """A GenerateResult from a generate_path response."""
        raise NotImplementedError

    @staticmethod
    async def _read_body(resp: aiohttp.ClientResponse) -> dict | list:
        """The decoded body of a 200 response."""
        raise NotImplementedError

    async def _pause_server(self) -> None:
        """Ask the server to abort in-flight requests and hold new ones."""
        raise NotImplementedError

    async def _abort_requests(self) -> None:
        """Abort whatever is still running on the server."""
        raise NotImplementedError

    async def _resume_server(self) -> None:
        """Ask the server to run held requests again."""
        raise NotImplementedError

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def launch(self) -> None:
        """Start the server process (in its own process group: stop() ends it and its worker children)."""
        cmd = self.server_command()
        log.info("starting %s: %s", self.name, redact_command(cmd))
        if self.log_path is None:
            self.proc = subprocess.Popen(cmd, env=self.server_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
            return
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=self.server_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    async def start(self) -> None:
        if self.model_path is not None and self.proc is None:
            self.launch()
        await self.wait_healthy(self.startup_timeout)

    async def wait_healthy(self, timeout: float) -> None:
        start = time.monotonic()
        last_note = start
        while time.monotonic() - start < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"{self.name} server exited with code {self.proc.returncode} during start-up (log: {self.log_path or 'not kept'})")
            if await self.health():
                log.info("%s at %s healthy after %.1f s", self.name, self.url, time.monotonic() - start)
                return
            if time.monotonic() - last_note > 15:
                log.info("waiting for %s at %s (%.0f s)", self.name, self.url, time.monotonic() - start)
                last_note = time.monotonic()
            await asyncio.sleep(self.health_poll_s)
        raise EngineError(f"{self.name} at {self.url} not healthy after {timeout:.0f} s")

    async def close(self) -> None:
        """Close the HTTP session only (the server keeps running)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stop(self) -> None:
        await self.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, self.stop_grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(self.proc.wait)
        self.proc = None
        if self._held is not None:
            self._held.close()
            self._held = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP ----------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap (aiohttp's default is 100): the agent's concurrency is the cap. With one, the
            # generations past 100 would queue in this process, not the engine's scheduler, and /pause (a weight
            # update) would wait behind running generations for a free connection. Idle ones: IDLE_CONNECTION_SECONDS.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout), headers=self._headers,
                                                  connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_SECONDS))
        return self._session

    async def _post(self, path: str, json: dict | None = None, params: dict | None = None) -> dict | list:
        try:
            async with self._http().post(self.url + path, json=json, params=params) as resp:
                if resp.status != 200:
                    raise EngineError(f"{self.name} {path} returned HTTP {resp.status}: {(await resp.text())[:500]}", status=resp.status)
                return await self._read_body(resp)
        except aiohttp.ClientError as exc:
            raise EngineError(f"{self.name} {path} at {self.url}: {exc}") from exc

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + self.health_path, timeout=aiohttp.ClientTimeout(total=self.health_timeout)) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    # -- generation and pausing ----------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        await self._gate.wait()
        version = self._version
        self._in_flight += 1
        try:
            body = await self._post(self.generate_path, json=self.request_payload(req))
        finally:
            self._in_flight -= 1
        return self.parse_response(body, version)

    supports_n: ClassVar[bool] = False
    """Whether one generate_path request can ask for n samples of one prompt (request_payload + "n", parse_choices)."""

    @staticmethod
    def with_n(payload: dict, n: int) -> dict:
        """request_payload asking for n samples (where the server's request names it)."""
        return {**payload, "n": n}

    @staticmethod
    def parse_choices(body: dict | list, version: int) -> list[GenerateResult]:
        """Every sample of an n-sample response, in order (engines with supports_n)."""
        raise NotImplementedError

    async def generate_n(self, req: GenerateRequest, n: int) -> list[GenerateResult]:
        """n samples of one unseeded request: one request that shares the prompt's prefill where the server takes n,
        else n requests. Each result is a piece as from generate (finish_reason abort: continue it alone)."""
        if req.seed is not None:
            raise ValueError("generate_n takes unseeded requests only (one seed would give n equal samples); send seeded ones one by one")
        if n == 1 or not self.supports_n:
            return list(await asyncio.gather(*(self.generate(req) for _ in range(n))))
        await self._gate.wait()
        version = self._version
        self._in_flight += 1
        try:
            body = await self._post(self.generate_path, json=self.with_n(self.request_payload(req), n))
        finally:
            self._in_flight -= 1
        results = self.parse_choices(body, version)
        if len(results) != n:
            raise EngineError(f"{self.name} {self.generate_path}: asked for {n} samples, got {len(results)}")
        return results

    async def pause(self) -> None:
        """Hold new generations, abort in-flight ones (they return finish_reason abort) and wait until they have all come back.

        If pausing fails (a dead engine, say), generation is let go again before the error is raised: held at the gate
        it would wait for ever, where sent on it fails and the agent notices the engine is gone."""
        self._gate.clear()
        try:
            await self._pause_server()
            # A request that reached the server after the pause would wait for resume and then run on the
            # new weights while stamped with the old version: abort until everything sent has returned.
            deadline = time.monotonic() + 60
            while self._in_flight:
                await self._abort_requests()
                for _ in range(self.drain_polls):
                    if not self._in_flight:
                        break
                    await asyncio.sleep(self.drain_poll_s)
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.name}: {self._in_flight} generations still running 60 s after {self.pause_path}")
        except Exception:
            try:
                await self.resume()  # the weights did not change: generation goes on with the version it had
            except Exception as exc:  # noqa: BLE001  the pause's own error is the one to raise
                log.debug("%s: resume after a failed pause failed too: %s", self.name, exc)
            raise

    async def resume(self) -> None:
        """Let held and new generations run again. The gate opens even when the server is gone (killed during a weight
        update): generations held at it would wait for ever, where sent on they fail and the agent notices."""
        try:
            await self._resume_server()
        finally:
            self._gate.set()
