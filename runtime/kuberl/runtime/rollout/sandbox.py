"""A sandbox for model-written Python (the code tool of tool-integrated reasoning).

`run_python(code, limits)` runs the code in a fresh `python -I -B` process in its own session and
temporary directory, with an empty environment, CPU, address-space, file-size and open-file limits
(setrlimit), and the kernel's confinement (confine.py: no capabilities; Landlock: read-only access to the
interpreter and system libraries, write access to its directory, nothing else, so no /proc of the agent, no
Secret or work directory, no TCP; seccomp: no socket, ptrace or process_vm_readv), plus its own network
namespace where the kernel allows one and an audit hook that refuses sockets, subprocesses, ctypes and writes
outside its directory. A wall-clock timeout kills its process group; its output is capped. It never raises
for what the code does: the result says.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from kuberl.api.v1alpha1 import SandboxSpec
from kuberl.runtime.rollout import confine

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
FILE_SIZE_LIMIT = 16 * 1024 * 1024  # bytes one run may write into its directory
OPEN_FILES_LIMIT = 64

# Runs inside the sandboxed interpreter: installs the audit hook, then executes the code from stdin.
BOOTSTRAP = r'''
import os, sys
_HOME = os.path.realpath(os.getcwd())
_NET = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
        "socket.sendto", "socket.sendmsg", "socket.socketpair"}
_PROC = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.spawn",
         "ctypes.dlopen", "ctypes.dlsym", "os.kill", "os.killpg", "signal.pthread_kill", "os.setuid", "os.chroot"}
_FS = {"os.remove", "os.rmdir", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.symlink", "os.link", "os.mkdir",
       "shutil.rmtree", "os.utime", "os.chdir"}
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _inside(path):
    try:
        return os.path.realpath(os.fsdecode(path)).startswith(_HOME + os.sep)
    except Exception:
        return False

def _hook(event, args):
    if event in _NET:
        raise PermissionError("sandbox: network access is not allowed")
    if event in _PROC:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and not isinstance(args[0], int):
        mode, flags = args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE)
        if writing and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {os.fsdecode(args[0])} is not allowed (only the working directory)")
    if event in _FS and args and isinstance(args[0], (str, bytes, os.PathLike)) and not _inside(args[0]):
        raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

_code = sys.stdin.read()
sys.stdin = open(os.devnull)
sys.addaudithook(_hook)
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    """What a run did: output (capped), exit code, and why it ended badly if it did."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    network: str = ""  # "netns" (own network namespace) or "audit-hook" (socket creation refused)
    isolation: tuple[str, ...] = ()  # the kernel layers that confined it (confine.probe(): capabilities, landlock-vN, seccomp)

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.exit_code == 0

    @property
    def error(self) -> str:
        """A one-line reason for a failed run ('' when it succeeded)."""
        if self.timed_out:
            return "timed out: the code ran past the sandbox's time limit and was killed"
        if self.exit_code is not None and self.exit_code < 0:
            sig = signal.Signals(-self.exit_code).name
            hint = " (CPU time limit)" if sig in ("SIGXCPU", "SIGKILL") else ""
            return f"killed by {sig}{hint}"
        if self.exit_code:
            last = [line for line in self.stderr.strip().splitlines() if line.strip()]
            return last[-1] if last else f"exited with code {self.exit_code}"
        return ""

    def observation(self) -> str:
        """The text fed back to the model."""
        if self.ok:
            return self.stdout if self.stdout.strip() else "(no output)"
        out = f"Error: {self.error}"
        return out + (f"\nOutput before the error:\n{self.stdout}" if self.stdout.strip() else "")


def _own_network_namespace() -> bool:
    """In the child before exec: a network namespace of its own (only loopback, down) if the kernel lets us."""
    libc = ctypes.CDLL(None, use_errno=True)
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return True
    return False


class SandboxError(RuntimeError):
    """The sandbox could not start a run as confined as it must be (the reason names the step and the errno)."""


def _limits(spec: SandboxSpec, home: str, netns_flag: str, error_file: str):
    confine.read_only_paths()  # computed here, before the fork, once per process

    def apply() -> None:
        # subprocess reports only "Exception occurred in preexec_fn": the reason goes to a file for run_python to raise.
        err = os.open(error_file, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.setsid()  # its own process group: a timeout kills everything it started
            if _own_network_namespace():
                with open(netns_flag, "w") as f:
                    f.write("1")
            resource.setrlimit(resource.RLIMIT_CPU, (spec.cpu_seconds, spec.cpu_seconds + 1))
            mem = spec.memory_mib * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            confine.confine(home)  # no capabilities, Landlock to `home`, the seccomp filter (confine.py)
            # Last: the descriptors the caller holds are still open here (subprocess closes them after this function),
            # and a busy agent holds more than the limit, so Landlock's ruleset would get EMFILE under it. Lowering a
            # limit needs no capability.
            resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES_LIMIT, OPEN_FILES_LIMIT))
        except BaseException as exc:
            os.write(err, f"{type(exc).__name__}: {exc}".encode(errors="replace"))
            raise
        finally:
            os.close(err)
    return apply


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept, truncated = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > max(room, 0):
            truncated = True  # keep draining so the child never blocks on a full pipe
    return bytes(kept), truncated


async def run_python(code: str, spec: SandboxSpec | None = None, *, audit_hook: bool = True) -> SandboxResult:
    """Run `code` in the sandbox and return what happened (never raises for the code's faults).

    `audit_hook=False` leaves only the process-level isolation (tests use it to check the network namespace alone).
    """
    spec = spec or SandboxSpec()
    boot = BOOTSTRAP if audit_hook else BOOTSTRAP.replace("sys.addaudithook(_hook)", "pass")
    cap = spec.max_output_chars
    with tempfile.TemporaryDirectory(prefix="kuberl-sandbox-") as home:
        flag, error_file = os.path.join(home, ".netns"), os.path.join(home, ".confine-error")
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-B", "-c", boot, cwd=home, env=env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_limits(spec, home, flag, error_file),
            )
        except subprocess.SubprocessError as exc:
            with open(error_file, errors="replace") as f:
                raise SandboxError(f"the sandbox could not confine the run: {f.read() or exc}") from None
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        proc.stdin.write(code.encode())
        proc.stdin.close()
        readers = asyncio.gather(_read_capped(proc.stdout, cap * 4), _read_capped(proc.stderr, cap * 4))
        timed_out = False
        try:
            (out, t1), (err, t2) = await asyncio.wait_for(asyncio.shield(readers), spec.timeout_seconds)
            code_ = await proc.wait()
        except TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code_ = await proc.wait()
            (out, t1), (err, t2) = await readers
        network = "netns" if os.path.exists(flag) else "audit-hook"
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    truncated = t1 or t2 or len(stdout) > cap or len(stderr) > cap
    return SandboxResult(stdout=stdout[:cap], stderr=stderr[-cap:], exit_code=code_, timed_out=timed_out, truncated=truncated, network=network,
                         isolation=tuple(confine.probe()))
