"""Run the real operator (`kuberl operator`, standalone unless asked to peer) as a subprocess against a kubeconfig.

Used by tests/integration/test_operator*.py and e2e_tests/conftest.py: starts it, waits for kopf's
liveness endpoint, and stops it by PID (SIGTERM, then SIGKILL), keeping its log for failure reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from kuberl.net import free_port
from kuberl.testing.control_plane import stop_processes


class OperatorProcess:
    """`with OperatorProcess(kubeconfig, log_path) as op:` ... `op.metrics()` ... `op.log_tail()`."""

    def __init__(self, kubeconfig: str | Path, log_path: str | Path, *, interval: float = 1.0,
                 checkpoint_timeout: float = 10.0, retry: float = 2.0, extra_env: dict[str, str] | None = None,
                 standalone: bool = True, leader_election: bool = False):
        self.kubeconfig, self.log_path, self.standalone = str(kubeconfig), Path(log_path), standalone
        self.leader_election = leader_election  # --leader-election: a Lease in $POD_NAMESPACE (extra_env), as the chart runs it
        self.metrics_port, self.health_port = free_port(), free_port()
        self.env = {**os.environ, "KUBECONFIG": self.kubeconfig, "KUBERL_OPERATOR_INTERVAL": str(interval),
                    "KUBERL_CHECKPOINT_TIMEOUT": str(checkpoint_timeout), "KUBERL_OPERATOR_RETRY": str(retry),
                    **(extra_env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self._log = self.log_path.open("wb")
        self._start()
        return self

    def restart(self) -> None:
        """kill -9 the operator (as a node loss or an OOM kill would) and start a new one on the same ports and log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.write(b"\n----- operator killed (SIGKILL) and started again -----\n")
        self._log.flush()
        self._start()

    def _start(self) -> None:
        # $KUBERL_TEST_OPERATOR_CMD runs another entry point (e.g. an installed `kuberl`) instead.
        prefix = os.environ.get("KUBERL_TEST_OPERATOR_CMD", "").split() or [sys.executable, "-m", "kuberl.cli"]
        cmd = [*prefix, "operator", *(["--standalone"] if self.standalone else []), *(["--leader-election"] if self.leader_election else []),
               "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port)]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"the operator did not become live within 60 s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_processes([self.proc])
        self._log.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, what: str, fn: Callable[[], Any], timeout: float = 60, period: float = 0.3) -> Any:
        """Poll `fn` until it returns something true (returned); fails at once if this operator dies, and after
        `timeout` seconds, either way with the operator's log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = fn()
            if value:
                return value
            assert self.alive, f"the operator died while waiting for {what}:\n{self.log_tail()}"
            time.sleep(period)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n--- operator log ---\n{self.log_tail()}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
