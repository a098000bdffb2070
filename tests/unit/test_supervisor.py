"""`kuberl run`'s supervision: a dead nats-server comes back on its port and store, a crash-looping role
stops the run with one line naming it and `kuberl run --resume`, and a dead role leaves no process behind."""

from __future__ import annotations

import socket
import sys
import time

import psutil
import pytest

from kuberl.api import RLExperiment
from kuberl.runtime import supervisor as sup
from kuberl.runtime.bus.server import start_nats_server
from kuberl.runtime.launcher import LocalRun


def make_run(tmp_path, **policy) -> LocalRun:
    exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3},
        "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
        "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "failurePolicy": {"maxRestarts": 3, "backoffSeconds": 0, **policy}}})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    for role in run.roles:  # stand-in commands: these tests are about the supervision, not the roles
        role.argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    return run


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_killed_nats_server_is_restarted_on_the_same_port_and_store(tmp_path, capsys):
    server = start_nats_server(store_dir=str(tmp_path / "store"))
    bus = sup.BusProcess(server)
    run = make_run(tmp_path)
    s = sup.Supervisor(run, bus)
    try:
        port, store = server.port, server.store_dir
        server.kill()
        deadline = time.monotonic() + 30
        while not bus.alive() and time.monotonic() < deadline:
            assert s.check() is None
            time.sleep(0.2)
        assert bus.alive() and bus.server.pid != server.pid
        assert (bus.server.port, bus.server.store_dir) == (port, store) and accepts(port)
        err = capsys.readouterr().err
        assert "nats-server (the bus) killed by SIGKILL; restarting it in 1s on the same port and store (1/5)" in err
        assert "nats-server is back" in err
    finally:
        bus.stop()


def test_a_nats_server_that_will_not_start_again_stops_the_run_with_one_line_naming_the_store(tmp_path, monkeypatch):
    monkeypatch.setattr(sup, "ROLE_BACKOFF_MAX", 0.0)
    server = start_nats_server(store_dir=str(tmp_path / "store"))
    bus = sup.BusProcess(server)
    run = make_run(tmp_path)
    s = sup.Supervisor(run, bus)
    try:
        server.kill()
        # Something else takes the port: the server cannot come back there.
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", server.port))
        blocker.listen()
        failure = None
        deadline = time.monotonic() + 120
        while failure is None and time.monotonic() < deadline:
            failure = s.check()
            time.sleep(0.05)
        blocker.close()
        assert failure is not None and "\n" not in failure
        assert failure.startswith("nats-server (the bus) would not start again")
        assert str(tmp_path / "store") in failure and "kuberl run --resume" in failure
    finally:
        bus.stop()


def test_an_agent_that_crash_loops_stops_the_run_naming_it_and_the_resume_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sup, "ROLE_BACKOFF_MAX", 0.0)
    run = make_run(tmp_path)
    agent = next(r for r in run.roles if r.name == "rollout-0")
    agent.argv = [sys.executable, "-c", "raise SystemExit(1)"]
    s = sup.Supervisor(run)
    agent.start()
    failure = None
    deadline = time.monotonic() + 60
    while failure is None and time.monotonic() < deadline:
        failure = s.check()
        time.sleep(0.05)
    assert failure is not None and failure.startswith("rollout-0 exited with code 1 6 times in a row")
    assert f"kuberl run --resume {run.manifest} --workdir {run.workdir}" in failure
    assert agent.restarts == sup.ROLE_CRASH_LIMIT


def test_a_role_that_died_leaves_no_child_behind_and_is_restarted(tmp_path):
    run = make_run(tmp_path)
    engine = next(r for r in run.roles if r.name == "engine-0")
    # A server whose worker child outlives it (as vLLM's engine core does after kill -9 of the server).
    engine.argv = [sys.executable, "-c",
                   "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
    engine.start()
    time.sleep(1.0)
    children = psutil.Process(engine.proc.pid).children()
    assert children
    s = sup.Supervisor(run)
    engine.proc.kill()
    engine.proc.wait()
    assert s.check() is None
    psutil.wait_procs(children, timeout=5)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    deadline = time.monotonic() + 10
    while not engine.alive() and time.monotonic() < deadline:
        s.check()
        time.sleep(0.1)
    assert engine.alive() and engine.restarts == 1
    run.stop_all()


@pytest.mark.parametrize("code, text", [(-9, "killed by SIGKILL"), (1, "exited with code 1")])
def test_exits_are_described_in_words(code, text):
    assert sup.describe_exit(code) == text
