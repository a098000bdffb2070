"""Local supervision for `kuberl run`: restarts every dead process of the run, the nats-server included.

LocalRun.supervise and the launcher's main loop call `Supervisor.check()` about once a second. The
trainer follows spec.failurePolicy (maxRestarts, backoffSeconds doubling: it resumes from a checkpoint);
the bus, engines and agents come back after 1 s doubling to 30 s, and the run stops when one of them
crash-loops (ROLE_CRASH_LIMIT deaths in a row, each within HEALTHY_SECONDS of its start). Every restart
is one line on the terminal; an unrecoverable fault is one line naming what failed and what to do.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuberl.runtime.bus.server import NatsServer, NatsServerError
from kuberl.runtime.errors import CONFIG_ERROR_EXIT

log = logging.getLogger("kuberl.run")

ROLE_CRASH_LIMIT = 5
"""Deaths in a row (each within HEALTHY_SECONDS of its start) before the run gives up on a bus, engine or agent."""
HEALTHY_SECONDS = 120.0
"""A process that ran this long before dying starts its backoff and crash count again."""
ROLE_BACKOFF_MAX = 30.0
BUS_STOP_SECONDS = 3.0
"""SIGTERM to SIGKILL for the run's nats-server when the run stops (after its roles: they may still use it)."""


def say(line: str) -> None:
    """One line on the terminal (and in the launcher log)."""
    log.warning(line)
    print(f"kuberl run: {line}", file=sys.stderr, flush=True)


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def kill_group(pid: int) -> None:
    """SIGKILL what is left of a dead role's process group (vLLM's engine core outlives its server)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class BusProcess:
    """The run's own nats-server as a supervised process: restarted on the same port, store and token."""

    name = "nats-server"

    def __init__(self, server: NatsServer) -> None:
        self.server = server
        self.restarts = 0
        self.last_error = ""

    @property
    def url(self) -> str:
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    @property
    def returncode(self) -> int | None:
        return self.server.proc.poll()

    def restart(self) -> bool:
        """Start a new server in place of the dead one; False (reason in last_error) if it would not start."""
        try:
            self.server = self.server.respawn()
        except NatsServerError as exc:
            self.last_error = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no output"
            log.error("nats-server restart failed: %s", exc)
            return False
        self.restarts += 1
        return True

    def stop(self) -> None:
        self.server.stop(BUS_STOP_SECONDS, remove_store=False)


@dataclass
class _Crashes:
    streak: int = 0  # deaths in a row, each soon after its start
    started: float = 0.0  # monotonic time of the current run of the process
    next_start: float = 0.0


class Supervisor:
    """Restart policy of one local run: `check()` restarts what died, returns a failure line or None."""

    def __init__(self, run: Any, bus: BusProcess | None = None, *, manifest_hint: str | None = None) -> None:
        self.run = run
        self.bus = bus
        self.crashes: dict[str, _Crashes] = {}
        now = time.monotonic()
        for name in [r.name for r in run.roles] + ([bus.name] if bus else []):
            self.crashes[name] = _Crashes(started=now)
        self.resume_hint = manifest_hint or f"kuberl run --resume {run.manifest} --workdir {run.workdir}"

    # -- the run's roles ------------------------------------------------------------------------

    def check(self) -> str | None:
        failure = self._check_bus()
        if failure:
            return failure
        policy = self.run.exp.spec.failure_policy
        now = time.monotonic()
        for role in self.run.roles:
            if role.done or role.alive():
                continue
            state = self.crashes.setdefault(role.name, _Crashes(started=now))
            if role.started and role.next_start == 0.0:
                code = role.exit_code()
                role.reap()
                if role is self.run.trainer and code == 0:
                    role.done = True
                    continue
                if code == CONFIG_ERROR_EXIT:  # the roles' exit code for a bad setting: a restart cannot fix it
                    self.run.config_error = True
                    reason = role.termination_message() or "no reason given"
                    return f"{role.name} stopped on a configuration error (exit 2): {reason}; see {role.log_path}"
                if role is self.run.trainer:
                    if role.restarts >= policy.max_restarts:
                        return (f"trainer {describe_exit(code)} after {role.restarts} restarts (failurePolicy.maxRestarts); "
                                f"see {role.log_path}; to continue from its last checkpoint: {self.resume_hint}")
                    delay = min(policy.backoff_seconds * (2**role.restarts), 300)
                else:
                    state.streak = state.streak + 1 if now - state.started < HEALTHY_SECONDS else 1
                    if state.streak > ROLE_CRASH_LIMIT:
                        return (f"{role.name} {describe_exit(code)} {state.streak} times in a row, each within "
                                f"{HEALTHY_SECONDS:.0f}s of its start; see {role.log_path}; after fixing it: {self.resume_hint}")
                    delay = min(2.0 ** (state.streak - 1), ROLE_BACKOFF_MAX)
                limit = policy.max_restarts if role is self.run.trainer else ROLE_CRASH_LIMIT
                count = role.restarts + 1 if role is self.run.trainer else state.streak
                say(f"{role.name} {describe_exit(code)}; restarting it in {delay:.0f}s ({count}/{limit})")
                role.next_start = now + delay
            if role.next_start and now >= role.next_start:
                role.restarts += 1
                role.next_start = 0.0
                state.started = now
                role.start()
        return None

    # -- the bus --------------------------------------------------------------------------------

    def _check_bus(self) -> str | None:
        bus = self.bus
        if bus is None or bus.alive():
            return None
        state = self.crashes[bus.name]
        now = time.monotonic()
        if state.next_start == 0.0:
            state.streak = state.streak + 1 if now - state.started < HEALTHY_SECONDS else 1
            if state.streak > ROLE_CRASH_LIMIT:
                return self._bus_failure(f"died {state.streak} times in a row")
            delay = min(2.0 ** (state.streak - 1), ROLE_BACKOFF_MAX)
            say(f"nats-server (the bus) {describe_exit(bus.returncode)}; restarting it in {delay:.0f}s on the same port "
                f"and store ({state.streak}/{ROLE_CRASH_LIMIT})")
            state.next_start = now + delay
        if now < state.next_start:
            return None
        state.next_start = 0.0
        state.started = time.monotonic()
        if bus.restart():
            say(f"nats-server is back (pid {bus.server.pid}, {bus.url}, store {bus.server.store_dir})")
            return None
        state.next_start = time.monotonic() + min(2.0 ** state.streak, ROLE_BACKOFF_MAX)
        state.streak += 1
        if state.streak > ROLE_CRASH_LIMIT:
            return self._bus_failure(f"would not start again ({bus.last_error})")
        say(f"nats-server would not start ({bus.last_error}); trying again ({state.streak}/{ROLE_CRASH_LIMIT})")
        return None

    def _bus_failure(self, what: str) -> str:
        store = self.bus.server.store_dir if self.bus else "?"
        return (f"nats-server (the bus) {what}; its JetStream store {store} may be damaged (its log: "
                f"{self.bus.server.log_path if self.bus else '?'}); the checkpoints are kept: {self.resume_hint}")


def route_logs(path: Path) -> None:
    """Everything the launcher process logs (nats-py, asyncio tracebacks) goes to `path`; only the
    launcher's own lines (kuberl.run) reach the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for h in list(root.handlers):
        root.removeHandler(h)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(fmt)
    root.addHandler(to_file)
    root.setLevel(logging.INFO)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(fmt)
    terminal.addFilter(lambda r: r.name == "kuberl.run" and r.exc_info is None and r.levelno < logging.WARNING)
    root.addHandler(terminal)
