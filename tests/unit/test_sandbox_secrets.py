"""Tool code tries to steal the rollout agent's secrets, and fails to (issue: a sandbox that holds).

An "agent" process starts as the rollout agent does (`protect_agent`: PR_SET_DUMPABLE 0) with a secret in its
environment (as the pod's secretKeyRef env vars are) and one in a file it can read (as a mounted Secret is), then runs
model-written code in the sandbox with the audit hook OFF, so that only the kernel's layers (confine.py: no
capabilities, Landlock, seccomp) stand between the code and the secrets. The code tries every route we know: the
agent's and PID 1's /proc environ and memory, its own environment, the secret file, a TCP connection to a listener
on loopback, a UDP socket, ptrace and process_vm_readv through ctypes. Nothing it prints may hold a secret.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kuberl.runtime.rollout import confine

SECRET = "s3cret-bus-password-7d1f"

THIEF = textwrap.dedent(r'''
    import ctypes, json, os, socket, sys
    agent, port, secret_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    got = {}
    def attempt(name, fn):
        try:
            got[name] = "GOT " + repr(fn())[:4000]
        except Exception as exc:
            got[name] = "denied " + type(exc).__name__
    attempt("agent environ", lambda: open(f"/proc/{agent}/environ", "rb").read())
    attempt("agent cmdline", lambda: open(f"/proc/{agent}/cmdline", "rb").read())
    attempt("pid 1 environ", lambda: open("/proc/1/environ", "rb").read())
    attempt("own environ", lambda: dict(os.environ))
    attempt("secret file", lambda: open(secret_file).read())
    attempt("secret dir", lambda: os.listdir(os.path.dirname(secret_file)))
    def mem():
        maps = open(f"/proc/{agent}/maps").read().splitlines()
        return open(f"/proc/{agent}/mem", "rb").read(1)
    attempt("agent mem", mem)
    attempt("tcp to loopback", lambda: socket.create_connection(("127.0.0.1", port), timeout=2).recv(100))
    attempt("udp socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    libc = ctypes.CDLL(None, use_errno=True)
    def ptrace():
        if libc.ptrace(16, agent, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")
        return "attached"
    attempt("ptrace", ptrace)
    def vm_read():
        buf = ctypes.create_string_buffer(64)
        class iovec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
        local, remote = iovec(ctypes.addressof(buf), 64), iovec(0x400000, 64)
        if libc.process_vm_readv(agent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) < 0:
            raise OSError(ctypes.get_errno(), "process_vm_readv")
        return buf.raw
    attempt("process_vm_readv", vm_read)
    print(json.dumps(got))
''')

AGENT = textwrap.dedent(r'''
    import asyncio, json, sys
    from kuberl.runtime.rollout.main import protect_agent
    from kuberl.runtime.rollout.sandbox import run_python
    from kuberl.api.v1alpha1 import SandboxSpec
    protect_agent()
    code, args = sys.stdin.read(), sys.argv[1:]
    code = "import sys; sys.argv = ['tool', " + ", ".join(repr(a) for a in [str(__import__('os').getpid()), *args]) + "]\n" + code
    r = asyncio.run(run_python(code, SandboxSpec(timeout_seconds=30, cpu_seconds=20), audit_hook=False))
    print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "exit": r.exit_code, "isolation": r.isolation}))
''')


def run_thief(tmp_path: Path, extra_env: dict[str, str] | None = None) -> dict:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "token").write_text(SECRET)
    (secrets / "token").chmod(0o644)  # a Secret volume's default mode
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.1)
    try:
        env = {**os.environ, "KUBERL_BUS_PASSWORD": SECRET, **(extra_env or {})}
        out = subprocess.run([sys.executable, "-c", AGENT, str(listener.getsockname()[1]), str(secrets / "token")], input=THIEF,
                             env=env, capture_output=True, text=True, timeout=120, check=False)
        try:
            listener.accept()[0].sendall(SECRET.encode())
            accepted = True
        except TimeoutError:
            accepted = False
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0, result["stderr"]
    return {"agent": result, "attempts": json.loads(result["stdout"]), "accepted": accepted}


def test_tool_code_reads_no_secret_of_the_agent_with_only_the_kernel_layers(tmp_path: Path) -> None:
    got = run_thief(tmp_path)
    attempts, agent = got["attempts"], got["agent"]
    assert SECRET not in json.dumps(agent), {k: v[:200] for k, v in attempts.items()}
    assert not got["accepted"], "the tool connected to a TCP listener on loopback"
    stolen = {k: v[:120] for k, v in attempts.items() if v.startswith("GOT") and k != "own environ"}
    assert stolen == {}, f"tool code got at {stolen}"
    assert "KUBERL" not in attempts["own environ"]  # its environment is a fresh one, not the agent's
    assert any(layer.startswith("landlock") for layer in agent["isolation"]), agent["isolation"]
    assert {"capabilities", "seccomp"} <= set(agent["isolation"])


def test_without_landlock_the_dumpable_flag_still_hides_the_agents_environment(tmp_path: Path) -> None:
    """One layer alone: a child with no Landlock (a kernel without it) cannot read the environment of the agent that
    protect_process() marked non-dumpable, though both are the same user with the same (no) capabilities, as in a pod."""
    code = textwrap.dedent('''
        import os, sys
        from kuberl.runtime.rollout import confine
        confine._drop_capabilities()  # the agent as in a pod: a user with no capabilities (root here would have them)
        confine.protect_process()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                data = open(f"/proc/{os.getppid()}/environ", "rb").read()
                os.write(w, b"GOT " + data)
            except OSError as exc:
                os.write(w, f"denied {exc.errno}".encode())
            os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        print(os.read(r, 1 << 20).decode(errors="replace"))
    ''')
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KUBERL_BUS_PASSWORD": SECRET},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("denied"), out.stdout[:300]
    assert SECRET not in out.stdout


@pytest.mark.parametrize("path", ["/proc/self/environ", "/etc/hostname", str(Path(__file__))])
def test_landlock_allows_the_interpreter_and_nothing_of_the_work_directory(path: str) -> None:
    """What the read-only list holds: the interpreter's prefix and the system's libraries, never /proc, /etc or the
    repository this test lives in (a work directory with checkpoints and credentials, on a cluster)."""
    allowed = confine.read_only_paths()
    assert any(sys.base_prefix == p or sys.base_prefix.startswith(p + "/") for p in allowed)
    assert not any(path == p or path.startswith(p.rstrip("/") + "/") for p in allowed), (path, allowed)


def test_the_reward_workers_which_inherit_the_agents_environment_hide_it_too(tmp_path: Path) -> None:
    """The reward pool's workers are fresh interpreters (exec makes a process dumpable again) with the agent's
    environment: each marks itself non-dumpable before anything else, so a process of the same user without
    capabilities (a tool run on a kernel without Landlock) cannot read its /proc environ."""
    code = textwrap.dedent('''
        import os, subprocess, sys, time
        from kuberl.runtime.rollout import confine
        confine._drop_capabilities()
        job_r, job_w = os.pipe()
        rep_r, rep_w = os.pipe()
        worker = subprocess.Popen([sys.executable, "-m", "kuberl.runtime.reward_pool", str(job_r), str(rep_w)], pass_fds=(job_r, rep_w))
        deadline, seen = time.monotonic() + 20, "never read"
        try:
            while time.monotonic() < deadline:
                try:
                    seen = "GOT " + open(f"/proc/{worker.pid}/environ", "rb").read().decode(errors="replace")
                except OSError as exc:
                    seen = f"denied {exc.errno}"
                    break
                time.sleep(0.05)
        finally:
            worker.kill()
        print(seen)
    ''')
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KUBERL_BUS_PASSWORD": SECRET},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("denied"), out.stdout[:300]
