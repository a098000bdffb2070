"""The sandbox as a server of its own (workflow.sandbox.placement pod), and the client the rollout agent calls it with.

`python -m kuberl.runtime.rollout.sandbox_server --port N` serves
- `POST /run` {"code": "...", "limits": {timeoutSeconds, cpuSeconds, memoryMib, maxOutputChars}} -> the SandboxResult as
  JSON. Each code runs through sandbox.run_python, as in the rollout agent: a fresh confined subprocess (rlimits,
  Landlock, seccomp, no capabilities, the audit hook), so the kernel's confinement stays as defence in depth behind
  the pod's own (no service-account token, no Secret, no egress, an optional runtimeClassName such as gVisor).
  At most --concurrency runs at once; up to --queue more (default 512) wait for a slot; beyond that a 503.
- `GET /healthz`: 200 with the confinement layers this kernel offers and the runs in flight.

On a cluster the operator runs it as the Deployment `{experiment}-sandbox` behind a Service, and gives the rollout
agents its URL in $KUBERL_SANDBOX_URL (operator builders/sandbox.py names the same string); `kuberl run` starts it as
a process of its own on a loopback port (launcher.py). `SandboxClient` is what the agent's tool calls go through
(AgentContext.run_python, agents/tir.py): the server's faults (refused, unreachable, a timeout, a bad answer) come
back as a failed SandboxResult whose error says so, never as an exception that would fail the episode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from kuberl.api.v1alpha1 import SandboxSpec
from kuberl.runtime.rollout import confine
from kuberl.runtime.rollout.sandbox import SandboxResult, run_python

log = logging.getLogger(__name__)

SANDBOX_URL_ENV = "KUBERL_SANDBOX_URL"  # the rollout agent's way to the server (placement pod)
LIMIT_FIELDS = ("timeout_seconds", "cpu_seconds", "memory_mib", "max_output_chars")  # what a request may set of SandboxSpec
MAX_REQUEST_BYTES = 1 << 20  # a code larger than 1 MiB is refused (413)
# Runs that may wait for a slot. The rollout agents start many episodes at once (rollout.concurrency groups x
# samplesPerPrompt each, per replica), and a refused call costs the episode its tool call: wait rather than refuse;
# the client's own timeout (the run's + CLIENT_SLACK_SECONDS) bounds the wait.
DEFAULT_QUEUE = 512
# How long the client waits beyond the run's own timeoutSeconds: the process start-up, a wait for a free slot, the network.
CLIENT_SLACK_SECONDS = 30.0
# A refused connection (the server starting, restarting, its pod not ready yet) is tried again for this long.
CONNECT_RETRY_SECONDS = 10.0
CONNECT_RETRY_DELAY = 0.5


def limits_of(spec: SandboxSpec) -> dict[str, Any]:
    """The per-run limits of `spec` as a request carries them (camelCase)."""
    return spec.model_dump(by_alias=True, include=set(LIMIT_FIELDS), mode="json")


def parse_limits(raw: Any) -> SandboxSpec:
    """A request's limits as a SandboxSpec (ValueError naming what is wrong): only LIMIT_FIELDS, by alias or name,
    within SandboxSpec's bounds; the rest take SandboxSpec's defaults."""
    if raw is None:
        return SandboxSpec()
    if not isinstance(raw, dict):
        raise ValueError("limits must be an object")
    allowed = {SandboxSpec.model_fields[f].alias or f: f for f in LIMIT_FIELDS} | {f: f for f in LIMIT_FIELDS}
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"limits: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(a for a in allowed if a not in LIMIT_FIELDS))}")
    try:
        return SandboxSpec.model_validate({allowed[k]: v for k, v in raw.items()})
    except ValidationError as exc:
        alias = {f: SandboxSpec.model_fields[f].alias or f for f in LIMIT_FIELDS}
        problems = "; ".join(f"{'.'.join(alias.get(str(p), str(p)) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"limits: {problems}") from None


def result_to_json(result: SandboxResult) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    out["isolation"] = list(result.isolation)
    return out


def result_from_json(data: Any) -> SandboxResult:
    """The SandboxResult a server answered (ValueError if it is not one)."""
    if not isinstance(data, dict):
        raise ValueError("the answer is not a JSON object")
    try:
        exit_code = data["exit_code"]
        if exit_code is not None and (not isinstance(exit_code, int) or isinstance(exit_code, bool)):
            raise ValueError(f"exit_code {exit_code!r} is not an integer")
        return SandboxResult(stdout=str(data["stdout"]), stderr=str(data["stderr"]), exit_code=exit_code,
                             timed_out=bool(data.get("timed_out", False)), truncated=bool(data.get("truncated", False)),
                             network=str(data.get("network", "")), isolation=tuple(str(x) for x in data.get("isolation") or ()))
    except KeyError as exc:
        raise ValueError(f"the answer has no {exc.args[0]!r}") from None


def unavailable(reason: str) -> SandboxResult:
    """A failed run that never ran: its error (the tool message) is `sandbox unavailable: <reason>`."""
    return SandboxResult(stdout="", stderr=f"sandbox unavailable: {reason}", exit_code=1)


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class SandboxServer:
    """Runs codes through run_python, at most `concurrency` at once and `queue` waiting."""

    def __init__(self, concurrency: int, queue: int) -> None:
        if concurrency < 1 or queue < 0:
            raise ValueError("concurrency must be >= 1 and queue >= 0")
        self.concurrency = concurrency
        self.queue = queue
        self.slots = asyncio.Semaphore(concurrency)
        self.running = 0
        self.waiting = 0
        self.runs = 0
        self.isolation = confine.probe()

    async def run(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _refuse(400, "the body must be JSON: {\"code\": \"...\", \"limits\": {...}}")
        if not isinstance(body, dict) or not isinstance(body.get("code"), str):
            return _refuse(400, "the body must be a JSON object with a string `code`")
        unknown = sorted(set(body) - {"code", "limits"})
        if unknown:
            return _refuse(400, f"unknown field(s) {', '.join(unknown)}; a request has code and limits")
        try:
            spec = parse_limits(body.get("limits"))
        except ValueError as exc:
            return _refuse(400, str(exc))
        if self.waiting >= self.queue and self.running >= self.concurrency:
            return _refuse(503, f"busy: {self.running} runs in flight and {self.waiting} waiting (--concurrency {self.concurrency}, "
                                f"--queue {self.queue})")
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            result = await run_python(body["code"], spec)
        finally:
            self.running -= 1
            self.slots.release()
        self.runs += 1
        return web.json_response(result_to_json(result))

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "isolation": self.isolation, "running": self.running, "waiting": self.waiting,
                                  "runs": self.runs, "concurrency": self.concurrency})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/run", self.run)
        app.router.add_get("/healthz", self.healthz)
        return app


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def default_concurrency() -> int:
    """The cores this process may use: its affinity, capped by the container's CPU limit (cgroup quota) where it has one."""
    from kuberl.runtime.resources import available_cpus, cgroup_cpu_limit

    cores = len(available_cpus())
    limit = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit)) if limit else cores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kuberl.runtime.rollout.sandbox_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (a pod: 0.0.0.0; default 127.0.0.1)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="runs at once (default: the CPUs this process may use, capped by its container's CPU limit)")
    parser.add_argument("--queue", type=int, default=DEFAULT_QUEUE, help=f"runs that may wait for a slot before a 503 (default {DEFAULT_QUEUE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s [sandbox] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not confine.protect_process():
        log.warning("PR_SET_DUMPABLE failed: processes of this user may read this server's /proc files")
    concurrency = args.concurrency or default_concurrency()
    server = SandboxServer(concurrency, args.queue)
    layers = server.isolation
    if not any(layer.startswith("landlock") for layer in layers):
        log.warning("this kernel offers no Landlock: tool code is kept by %s and the pod's own isolation only", ", ".join(layers))
    log.info("sandbox server on %s:%d (concurrency %d, queue %d; confinement: %s)", args.host, args.port, concurrency, server.queue,
             ", ".join(layers))
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None, reuse_address=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


class SandboxClient:
    """POSTs codes to a sandbox server (its base URL, e.g. http://exp-sandbox.ns.svc:8003); one HTTP session per event loop.

    `run` never raises for the server's faults: they come back as `unavailable(reason)`; a refused connection is tried
    again for `connect_retry_seconds` first."""

    def __init__(self, url: str, *, slack_seconds: float = CLIENT_SLACK_SECONDS, connect_retry_seconds: float = CONNECT_RETRY_SECONDS) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.slack = slack_seconds
        self.connect_retry = connect_retry_seconds
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # trust_env=False: an HTTP(S)_PROXY in the pod's environment must not reroute a call to the Service
            self._session = aiohttp.ClientSession(trust_env=False)
            self._loop = loop
        return self._session

    async def run(self, code: str, spec: SandboxSpec | None = None) -> SandboxResult:
        spec = spec or SandboxSpec()
        timeout = aiohttp.ClientTimeout(total=spec.timeout_seconds + self.slack)
        deadline = asyncio.get_running_loop().time() + self.connect_retry
        while True:
            try:
                return await self._post(code, spec, timeout)
            except aiohttp.ClientConnectorError as exc:
                # Refused before anything was sent: a server starting or restarting (its pod not ready yet). Retried, briefly.
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    return unavailable(f"cannot reach the sandbox server at {self.url}: {exc}")
                await asyncio.sleep(min(CONNECT_RETRY_DELAY, left))

    async def _post(self, code: str, spec: SandboxSpec, timeout: aiohttp.ClientTimeout) -> SandboxResult:
        """One request; raises only ClientConnectorError (nothing was sent: `run` may try again)."""
        try:
            session = self._session_here()
            async with session.post(f"{self.url}/run", json={"code": code, "limits": limits_of(spec)}, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    try:
                        why = json.loads(text).get("error") or text
                    except (ValueError, AttributeError):
                        why = text
                    return unavailable(f"the sandbox server at {self.url} answered {resp.status}: {str(why)[:300]}")
                return result_from_json(json.loads(text))
        except TimeoutError:
            return unavailable(f"no answer from the sandbox server at {self.url} within {timeout.total:g} s")
        except aiohttp.ClientConnectorError:
            raise
        except aiohttp.ClientError as exc:
            return unavailable(f"cannot reach the sandbox server at {self.url}: {type(exc).__name__}: {exc}")
        except ValueError as exc:
            return unavailable(f"the sandbox server at {self.url} gave no result: {exc}")

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


if __name__ == "__main__":
    sys.exit(main())
