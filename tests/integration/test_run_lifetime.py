"""A real `kuberl run` ends whole, however it ends (kuberl.runtime.lifetime): killed with SIGKILL at start-up, mid-run,
while every episode fails, or while a checkpoint is being written, nothing of the run (nats-server, the engine and its
engine core, the agent, the trainer, the guard) outlives it by more than GRACE seconds; stopped with SIGTERM in the
hard states (start-up, failing episodes, a checkpoint that does not finish) it ends within SIGTERM_BOUND seconds, the
bound `timeout -k 10` gives it, with nothing left. (Mid-run SIGINT: test_faults.py's Ctrl-C test.)

Every process of a run is found by an environment variable the test gives the launcher (each process inherits it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

from kuberl.runtime.lifetime import STOP_GRACE_SECONDS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

MARK = "KUBERL_TEST_RUN_ID"
GRACE = 5.0
"""How long a process of a launcher killed with SIGKILL may outlive it (the watchdogs poll every 0.25 s; a slow machine)."""
SIGTERM_BOUND = 10.0
"""SIGTERM to the launcher's exit, with every process of the run gone: STOP_GRACE_SECONDS for the roles, then the bus."""
HERE = Path(__file__).parent


def start_run(tmp_path: Path, state: str) -> tuple[subprocess.Popen, Path, str]:
    """`kuberl run` of the quickstart, set up to reach `state`: (the launcher, its workdir, its processes' mark)."""
    overrides: dict = {"training.totalSteps": 500}
    paths = [os.environ.get("PYTHONPATH", "")]
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    if state == "failing":  # every episode's reward raises (failing_reward.py)
        overrides["workflow.reward"] = "failing_reward:always_fails"
        paths.insert(0, str(HERE))
    if state == "checkpoint":  # the checkpoint of step 2 waits to be written while the hold file exists
        overrides.update({"checkpoint.everySteps": 2, "checkpoint.asyncSave": "off"})
        (tmp_path / "hold").touch()
        env["KUBERL_TEST_HOLD_DCP_WRITES"] = str(tmp_path / "hold")
        paths.insert(0, str(HERE / "held_checkpoint_writes"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    manifest = quickstart_manifest(tmp_path, f"life-{state}", **overrides)
    workdir = tmp_path / "work"
    out = open(tmp_path / "launcher.log", "w")
    run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                           cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return run, workdir, mark


def reached(state: str, tmp_path: Path, workdir: Path) -> bool:
    if state == "start-up":  # the roles are starting (vLLM importing, the trainer building its model)
        return "kuberl run: started" in (tmp_path / "launcher.log").read_text()
    if state == "mid-run":
        return len(read_metrics(workdir)) >= 2
    if state == "failing":
        log = workdir / "logs" / "rollout-0.log"
        return log.exists() and log.read_text().count("failed (delivery") >= 3
    return (workdir / "checkpoints" / ".tmp-step-00000002").is_dir()  # "checkpoint": being written, held


def wait_until(state: str, run: subprocess.Popen, tmp_path: Path, workdir: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not reached(state, tmp_path, workdir):
        assert run.poll() is None, f"the run ended (code {run.returncode}) before {state}:\n{tail(tmp_path, workdir)}"
        assert time.monotonic() < deadline, f"no {state} after {timeout:.0f}s:\n{tail(tmp_path, workdir)}"
        time.sleep(0.2)
    if state == "start-up":
        time.sleep(2.0)  # into the roles' imports


def processes_of(mark: str) -> list[psutil.Process]:
    """Live processes (not zombies) of the run: those whose environment carries its mark."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ppid {p.ppid()}: {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def left_after(mark: str, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := processes_of(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def tail(tmp_path: Path, workdir: Path) -> str:
    logs = [tmp_path / "launcher.log", *sorted((workdir / "logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs if p.exists())


def cleanup(run: subprocess.Popen, mark: str) -> None:
    """Never leave a failed test's processes to the next tests."""
    if run.poll() is None:
        run.kill()
        run.wait()
    for p in processes_of(mark):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("state", ["start-up", "mid-run", "failing", "checkpoint"])
def test_a_run_killed_with_sigkill_leaves_no_process_behind(tmp_path, state):
    run, workdir, mark = start_run(tmp_path, state)
    try:
        wait_until(state, run, tmp_path, workdir)
        roles = describe(processes_of(mark))
        assert any("nats-server" in r for r in roles) and any("kuberl.cli trainer" in r for r in roles), roles
        run.kill()
        run.wait()
        t0 = time.monotonic()
        left = describe(left_after(mark, GRACE))
        took = time.monotonic() - t0
    finally:
        cleanup(run, mark)
    assert left == [], f"{state}: outlived the launcher by {GRACE:.0f}s: {left}\nthe run had: {roles}"
    assert processes_mentioning(str(workdir)) == []
    print(f"{state}: {len(roles)} processes, all gone {took:.2f}s after the launcher's SIGKILL")


@pytest.mark.parametrize("state", ["start-up", "failing", "checkpoint"])
def test_a_run_stopped_with_sigterm_ends_within_the_bound_with_nothing_left(tmp_path, state):
    run, workdir, mark = start_run(tmp_path, state)
    try:
        wait_until(state, run, tmp_path, workdir)
        t0 = time.monotonic()
        run.send_signal(signal.SIGTERM)
        try:
            code = run.wait(timeout=SIGTERM_BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{state}: the launcher still ran {SIGTERM_BOUND:.0f}s after SIGTERM:\n{tail(tmp_path, workdir)}") from None
        took = time.monotonic() - t0
        left = describe(processes_of(mark))
    finally:
        cleanup(run, mark)
    assert code == 130, tail(tmp_path, workdir)
    assert left == [], f"{state}: left after the launcher's exit: {left}"
    out = (tmp_path / "launcher.log").read_text()
    assert "interrupted; stopping every role" in out and "Traceback" not in out, out[-3000:]
    print(f"{state}: the launcher exited {took:.2f}s after SIGTERM (roles' grace {STOP_GRACE_SECONDS:.0f}s)")


def test_a_run_whose_every_group_fails_stops_by_itself_with_the_reason_and_exit_2(tmp_path):
    """Every episode's reward raises: the run must not wait at step 0 forever with the reason only in the agent's log.
    After max_failed_in_a_row failed groups (8 at 2 prompts a step) the trainer stops as a configuration error, the
    launcher ends the run with exit 2 and prints the latest failure's reason."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))}
    manifest = quickstart_manifest(tmp_path, "all-fail", **{"training.totalSteps": 50, "algorithm.batchSize": 2,
                                                            "workflow.reward": "failing_reward:always_fails"})
    workdir = tmp_path / "work"
    run = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    assert "all failed and none could be trained" in out and "this reward always fails" in out, out[-3000:]
    assert not (workdir / "metrics.jsonl").exists() or read_metrics(workdir) == []  # no step was trained
    assert processes_mentioning(str(workdir)) == []
