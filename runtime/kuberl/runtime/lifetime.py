"""Process lifetimes: nothing `kuberl run` starts outlives it, however it ends (exit, crash, SIGKILL, the OOM killer,
a closed terminal). Used by the launchers (kuberl.runtime.launcher; on Ray, each RoleActor), `kuberl bus` for its
nats-server, and every role process.

The launcher holds a Lifeline: a pipe whose write end only it holds. However the launcher ends, the kernel closes that
end, and every holder of the read end reads EOF. Three layers act on it, each enough alone for what it covers:

1. The guard (`Lifeline.start_guard`, `kuberl run` only): a small process in a session of its own. At EOF it SIGKILLs
   every process whose environment carries the lifeline's value ($KUBERL_LIFELINE, inherited by everything the run
   starts: nats-server, the roles, vLLM's engine core, torchrun's ranks, whatever they start), then exits.
2. Each role is started (`Lifeline.popen_kwargs`) in a session of its own (a process group the launcher signals as
   one), holding the read end, with PR_SET_PDEATHSIG SIGKILL set before exec: the kernel kills it when the thread
   that started it ends (set only when that is the main thread, i.e. when the launcher process ends). A role that
   runs the watchdog (3.) hands it over to the watchdog: killed at once, it could not take its process group along.
3. Each role process calls `watch_parent()` first thing (kuberl.cli's role commands, the vLLM server wrapper, the
   torchrun wrapper): a thread that SIGKILLs the role's process group once the lifeline reads EOF or once the
   process's parent is gone. In a pod that is the peer that started it: torchrun for a rank, the vLLM server for its
   engine core (a process forked from a watched one watches again).

Stopping (SIGTERM, Ctrl-C, a closed terminal): every role gets SIGTERM at once, and STOP_GRACE_SECONDS later SIGKILL
for what is left of it; a second signal kills at once (LocalRun.stop_all).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable

LIFELINE_ENV = "KUBERL_LIFELINE"
"""'<fd>:<inode>:<token>': the read end of the launcher's pipe, and the mark the guard finds the run's processes by."""
ROLE_GROUP_ENV = "KUBERL_ROLE_PGID"
"""The process group a role leader set up for itself: its descendants in that group may SIGKILL it as a whole."""
STOP_GRACE_SECONDS = 5.0
"""SIGTERM to SIGKILL, for every role at once, when a run is stopped (SIGTERM, Ctrl-C, the end of training)."""
POLL_SECONDS = 0.25
"""How often a role's watchdog looks at its parent: a role outlives its launcher by about this much."""

_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2
_SIGKILL = int(signal.SIGKILL)
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child only calls it


class Lifeline:
    """A parent's end of the pipe its children's lives hang on (`kuberl run`'s, a RoleActor's, `kuberl bus`'s)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # both close-on-exec: only the children given read_fd hold it
        self.value = f"{self.read_fd}:{os.fstat(self.read_fd).st_ino}:{secrets.token_hex(8)}"
        self.guard: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {LIFELINE_ENV: self.value}

    def popen_kwargs(self, then: Callable[[], None] | None = None) -> dict:
        """subprocess.Popen arguments for a child tied to this lifeline (`then`: more to run in the child before exec)."""
        return {"start_new_session": True, "pass_fds": (self.read_fd,), "preexec_fn": die_with_parent(then)}

    def start_guard(self) -> None:
        """The guard process (layer 1): started before anything else of the run, so that it covers all of it."""
        self.guard = subprocess.Popen([sys.executable, "-m", "kuberl.runtime.lifetime"], env={**os.environ, **self.env()},
                                      stdin=subprocess.DEVNULL, pass_fds=(self.read_fd,), start_new_session=True)

    def close(self, timeout: float = 5.0) -> None:
        """Cut the lifeline (what is still tied to it dies) and wait for the guard."""
        for fd in (self._write_fd, self.read_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.guard is not None:
            try:
                self.guard.wait(timeout)
            except subprocess.TimeoutExpired:
                self.guard.kill()


def die_with_parent(then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when the calling thread ends, if that is the main thread (a worker
    thread may end long before its process); a parent already gone by then (the race) kills it at once."""
    parent = os.getpid()
    main = threading.current_thread() is threading.main_thread()

    def child() -> None:
        if main:
            _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), _SIGKILL)
        if then is not None:
            then()

    return child


def watch_parent() -> None:
    """In a role process: end the role's process group when the launcher (the lifeline) or this process's parent is gone."""
    global _armed, _watching, _deathsig_taken
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    if os.getpgrp() == os.getpid():  # a role leader: its descendants in this group may end it whole
        os.environ[ROLE_GROUP_ENV] = str(os.getpid())
    deathsig = ctypes.c_int(0)
    _prctl(_PR_GET_PDEATHSIG, ctypes.byref(deathsig), 0, 0, 0)
    if deathsig.value == _SIGKILL:
        # Killed by the kernel at once, this process could not take its group along (nats-server under `kuberl bus`, a
        # spawned worker): its watchdog kills the whole group instead (before_exec puts the signal back).
        _prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        _deathsig_taken = (os.getpid(), os.getppid())
    threading.Thread(target=_watch, args=(_lifeline_fd(), os.getppid()), name="kuberl-lifetime", daemon=True).start()
    if not _armed:  # a forked child (vLLM's engine core) has no threads: it watches its own parent again
        os.register_at_fork(after_in_child=watch_parent)
        _armed = True


_armed = False  # the at-fork hook is registered
_watching = 0  # the pid whose watchdog runs (a forked child has a new pid, and no threads)
_deathsig_taken: tuple[int, int] | None = None  # (this pid, its parent): watch_parent took the parent-death signal over


def before_exec() -> None:
    """Before a role process execs another program (`kuberl engine` execs the engine's server): its watchdog ends with
    the exec, so the parent-death signal watch_parent took over comes back (the program may start no watchdog)."""
    if _deathsig_taken is not None and _deathsig_taken[0] == os.getpid():
        _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
        if os.getppid() != _deathsig_taken[1]:  # gone meanwhile
            os.kill(os.getpid(), _SIGKILL)


def _lifeline_fd() -> int | None:
    """This process's read end of the lifeline; None when it has none (not started by a launcher, or an fd not passed on)."""
    try:
        fd, inode, _ = os.environ[LIFELINE_ENV].split(":")
        st = os.fstat(int(fd))
    except (KeyError, ValueError, OSError):
        return None
    return int(fd) if stat.S_ISFIFO(st.st_mode) and st.st_ino == int(inode) else None  # not some other file on that number


def _watch(fd: int | None, parent: int) -> None:
    while os.getppid() == parent:
        if fd is None:
            time.sleep(POLL_SECONDS)
            continue
        try:
            ready, _, _ = select.select([fd], [], [], POLL_SECONDS)
            if ready and _lifeline_fd() != fd:  # the process closed it, and the number went to another file
                fd = None
            elif ready and not os.read(fd, 1):  # EOF (nothing is ever written): the launcher is gone
                _end_role("its launcher is gone")
        except OSError:  # closed by the process: its parent alone tells
            fd = None
    _end_role(f"its parent (pid {parent}) is gone")


def _end_role(why: str) -> None:
    """SIGKILL this role's process group (or this process alone, in a group that is not the role's)."""
    pgid = os.getpgrp()
    whole = pgid == os.getpid() or os.environ.get(ROLE_GROUP_ENV) == str(pgid)
    os.write(2, f"kuberl: pid {os.getpid()}: {why}; killing {'its process group' if whole else 'it'}\n".encode())
    if whole:
        os.killpg(pgid, _SIGKILL)
    os.kill(os.getpid(), _SIGKILL)


def kill_marked(value: str) -> int:
    """SIGKILL every process (but this one) whose environment has LIFELINE_ENV=value; how many were found."""
    mark, found = f"{LIFELINE_ENV}={value}".encode(), 0
    for _ in range(3):  # a process may fork during a pass
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
        hits = [pid for pid in pids if _has_mark(pid, mark)]
        for pid in hits:
            try:
                os.kill(pid, _SIGKILL)
            except OSError:
                pass
        found += len(hits)
        if not hits:
            break
    return found


def _has_mark(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:  # gone, or not ours
        return False


def guard() -> None:
    """The guard process: wait for the lifeline's EOF, then kill what is left of the run."""
    value = os.environ[LIFELINE_ENV]
    fd = int(value.split(":")[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher, which stops the run itself
    while os.read(fd, 1):
        pass
    kill_marked(value)
    os._exit(0)  # at once: the launcher waits for it (a sitecustomize may have loaded torch, whose teardown takes seconds)


if __name__ == "__main__":
    guard()
