"""The sandbox server (workflow.sandbox.placement pod) as a real process, called through the rollout agent's client.

The server runs each code through sandbox.run_python, so the limits and the kernel's confinement hold as in the agent's
own subprocess: a wall-clock timeout, the CPU limit, no network. Its faults (unreachable, busy, a 500, no answer in
time, a bad request) reach the model as a failed tool call, never as an exception that fails the episode. And tool code
run there cannot get at a secret the rollout agent holds (its environment, a Secret-like file), by the routes
tests/unit/test_sandbox_secrets.py tries: the server process starts with a bare environment, as the sandbox pod does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kuberl.api.v1alpha1 import SandboxSpec
from kuberl.net import free_port
from kuberl.runtime.agents.tir import run_tool
from kuberl.runtime.rollout.agent_workflow import AgentContext, AgentWorkflow
from kuberl.runtime.rollout.registry import WorkflowError
from kuberl.runtime.rollout.sandbox_server import SANDBOX_URL_ENV, SandboxClient
from tests.unit.test_sandbox_secrets import SECRET, THIEF

pytestmark = pytest.mark.timeout(300)


def bare_env() -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


class Server:
    """`python -m kuberl.runtime.rollout.sandbox_server` on a loopback port, stopped by its pid."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"sandbox-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kuberl.runtime.rollout.sandbox_server", "--port", str(self.port), *args],
                                         env=bare_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the sandbox server did not listen within 60 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("sandbox"), "--concurrency", "2")
    yield s
    s.stop()


def run(code: str, url: str, spec: SandboxSpec | None = None, **client_kwargs: float):
    async def go():
        client = SandboxClient(url, **client_kwargs)
        try:
            return await client.run(code, spec)
        finally:
            await client.aclose()
    return asyncio.run(go())


def post(url: str, body: bytes) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s, s.post(f"{url}/run", data=body, headers={"Content-Type": "application/json"}) as r:
            return r.status, json.loads(await r.text() or "{}") if r.content_type == "application/json" else {}
    return asyncio.run(go())


def test_the_health_check_says_which_layers_confine_the_runs(server: Server) -> None:
    async def go():
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/healthz") as r:
            return r.status, await r.json()
    status, body = asyncio.run(go())
    assert status == 200 and body["status"] == "ok" and "capabilities" in body["isolation"] and body["concurrency"] == 2


def test_code_runs_and_its_output_comes_back(server: Server) -> None:
    r = run("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)", server.url)
    assert r.ok and r.stdout == "42\n" and "warn" in r.stderr
    assert {"capabilities", "seccomp"} <= set(r.isolation) and r.network in ("netns", "audit-hook")
    bad = run("print(1 / 0)", server.url)
    assert not bad.ok and bad.error == "ZeroDivisionError: division by zero"


def test_the_limits_hold_through_the_server(server: Server) -> None:
    slow = run("import time\ntime.sleep(30)", server.url, SandboxSpec(timeout_seconds=1.0))
    assert slow.timed_out and "timed out" in slow.observation()
    spin = run("while True:\n    pass", server.url, SandboxSpec(timeout_seconds=20.0, cpu_seconds=1))
    assert not spin.ok and "CPU time limit" in spin.error
    big = run("print('x' * 100000)", server.url, SandboxSpec(max_output_chars=100))
    assert big.truncated and len(big.stdout) == 100
    memory = run("b = bytearray(400 * 1024 * 1024)\nprint('allocated')", server.url, SandboxSpec(memory_mib=128))
    assert not memory.ok and "MemoryError" in memory.error


def test_tool_code_reaches_no_network_from_the_server(server: Server) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\nprint('connected')", server.url)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert not r.ok and "connected" not in r.stdout and "network access is not allowed" in r.error, r


def test_a_bad_request_is_refused_with_the_reason(server: Server) -> None:
    status, body = post(server.url, json.dumps({"code": "print(1)", "limits": {"timeoutSeconds": 1000}}).encode())
    assert status == 400 and "timeoutSeconds" in body["error"]
    status, body = post(server.url, json.dumps({"code": "print(1)", "limits": {"placement": "process"}}).encode())
    assert status == 400 and "unknown field(s) placement" in body["error"]
    status, body = post(server.url, b"not json")
    assert status == 400
    status, _ = post(server.url, json.dumps({"code": "#" * (2 << 20)}).encode())
    assert status == 413
    sent = run("print(1)", server.url, SandboxSpec(timeout_seconds=1.0), slack_seconds=5.0)
    assert sent.ok  # the client itself sends only what the server takes


def test_a_busy_server_answers_503_and_the_model_is_told(tmp_path: Path) -> None:
    busy = Server(tmp_path, "--concurrency", "1", "--queue", "0")
    try:
        async def go():
            client = SandboxClient(busy.url)
            try:
                first = asyncio.create_task(client.run("import time\ntime.sleep(3)\nprint('done')", SandboxSpec(timeout_seconds=10)))
                await asyncio.sleep(1.0)
                second = await client.run("print(2)")
                return await first, second
            finally:
                await client.aclose()
        first, second = asyncio.run(go())
    finally:
        busy.stop()
    assert first.ok and first.stdout == "done\n"
    assert not second.ok and second.observation().startswith("Error: sandbox unavailable: ") and "503" in second.error and "busy" in second.error


def test_server_faults_become_failed_tool_calls_not_exceptions() -> None:
    """Unreachable, a 500, a server that never answers, an answer that is no result: each a failed SandboxResult."""
    async def go():
        async def error(_: web.Request) -> web.Response:
            return web.json_response({"error": "boom"}, status=500)

        async def hang(_: web.Request) -> web.Response:
            await asyncio.sleep(60)
            return web.json_response({})

        async def garbage(_: web.Request) -> web.Response:
            return web.json_response({"stdout": "x"})

        app = web.Application()
        app.router.add_post("/error/run", error)
        app.router.add_post("/hang/run", hang)
        app.router.add_post("/garbage/run", garbage)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        out = {}
        try:
            spec = SandboxSpec(timeout_seconds=0.5)
            for name in ("error", "hang", "garbage"):
                client = SandboxClient(f"{base}/{name}", slack_seconds=1.0)
                out[name] = await client.run("print(1)", spec)
                await client.aclose()
            t0 = time.monotonic()
            client = SandboxClient(f"http://127.0.0.1:{free_port()}", connect_retry_seconds=1.0)
            out["unreachable"] = await client.run("print(1)", spec)
            out["retried for"] = time.monotonic() - t0
            await client.aclose()
        finally:
            await runner.cleanup()
        return out

    out = asyncio.run(go())
    assert "answered 500: boom" in out["error"].error
    assert "no answer from the sandbox server" in out["hang"].error and "1.5 s" in out["hang"].error
    assert "gave no result" in out["garbage"].error
    assert "cannot reach the sandbox server" in out["unreachable"].error and 0.9 <= out["retried for"] < 10
    for name in ("error", "hang", "garbage", "unreachable"):
        r = out[name]
        assert not r.ok and r.observation().startswith("Error: sandbox unavailable: "), (name, r)


def test_the_tir_tool_and_the_agent_context_run_on_the_server(server: Server) -> None:
    async def go():
        client = SandboxClient(server.url)
        try:
            tool = await run_tool("python", json.dumps({"code": "print(sum(range(10)))"}), SandboxSpec(), client)
            ctx = AgentContext(base_url="http://x", api_key="k", episode="e", timeout_seconds=10, sandbox=SandboxSpec(), sandbox_client=client)
            return tool, await ctx.run_python("import os\nprint(os.getpid() != 0)")
        finally:
            await client.aclose()
    tool, ctx = asyncio.run(go())
    assert not isinstance(tool, str) and tool.ok and tool.stdout == "45\n"
    assert ctx.ok and ctx.stdout == "True\n"


def test_the_agent_workflow_needs_the_url_with_placement_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    async def agent(client, item):
        return 1.0

    pod = SandboxSpec(placement="pod")
    with pytest.raises(WorkflowError, match=f"placement pod needs the sandbox server's URL in \\${SANDBOX_URL_ENV}"):
        AgentWorkflow(agent, None, None, lambda *a: 0.0, sandbox=pod, scorer=object())
    wf = AgentWorkflow(agent, None, None, lambda *a: 0.0, sandbox=pod, scorer=object(), sandbox_url="http://s:8003")
    assert wf.sandbox_client is not None and wf.sandbox_client.url == "http://s:8003"
    assert AgentWorkflow(agent, None, None, lambda *a: 0.0, scorer=object(), sandbox_url="http://s:8003").sandbox_client is None


AGENT = textwrap.dedent(r'''
    import asyncio, json, os, sys
    from kuberl.runtime.rollout.main import protect_agent
    from kuberl.runtime.rollout.sandbox_server import SandboxClient
    from kuberl.api.v1alpha1 import SandboxSpec
    protect_agent()
    url, args = sys.argv[1], sys.argv[2:]
    code = "import sys; sys.argv = ['tool', " + ", ".join(repr(a) for a in [str(os.getpid()), *args]) + "]\n" + sys.stdin.read()
    async def main():
        client = SandboxClient(url)
        try:
            return await client.run(code, SandboxSpec(timeout_seconds=30, cpu_seconds=20))
        finally:
            await client.aclose()
    r = asyncio.run(main())
    print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "exit": r.exit_code, "isolation": r.isolation}))
''')


def test_tool_code_on_the_server_reads_no_secret_of_the_agent(server: Server, tmp_path: Path) -> None:
    """The agent holds the secret in its environment and in a readable file; the code runs on the server (another
    process, started with a bare environment) and tries every route of test_sandbox_secrets' thief. The server runs
    codes with the audit hook on, as in production, which refuses `import ctypes` itself: the thief goes on without it
    (the kernel's layers alone, hook off, are test_sandbox_secrets')."""
    thief = THIEF.replace("import ctypes, json, os, socket, sys",
                          "import json, os, socket, sys\ntry:\n    import ctypes\nexcept PermissionError:\n    ctypes = None")
    thief = thief.replace("libc = ctypes.CDLL(None, use_errno=True)", "libc = ctypes.CDLL(None, use_errno=True) if ctypes else None")
    assert thief.count("if ctypes else None") == 1
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "token").write_text(SECRET)
    (secrets / "token").chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.1)
    try:
        env = {**os.environ, "KUBERL_BUS_PASSWORD": SECRET}
        out = subprocess.run([sys.executable, "-c", AGENT, server.url, str(listener.getsockname()[1]), str(secrets / "token")], input=thief,
                             env=env, capture_output=True, text=True, timeout=120, check=False)
        try:
            listener.accept()
            accepted = True
        except TimeoutError:
            accepted = False
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0, result["stderr"]
    attempts = json.loads(result["stdout"])
    assert SECRET not in json.dumps(result), {k: v[:200] for k, v in attempts.items()}
    assert not accepted, "the tool connected to a TCP listener on loopback"
    stolen = {k: v[:120] for k, v in attempts.items() if v.startswith("GOT") and k != "own environ"}
    assert stolen == {}, f"tool code got at {stolen}"
    assert "KUBERL" not in attempts["own environ"]
    assert attempts["agent environ"].startswith("denied") and attempts["secret file"].startswith("denied"), attempts
    server_environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().decode(errors="replace")
    assert SECRET not in server_environ and "KUBERL_BUS_PASSWORD" not in server_environ  # the server never had it
