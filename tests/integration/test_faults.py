"""Faults in a live `kuberl run`: kill -9 the trainer, a rollout agent, the engine or the nats-server mid-run; the run completes.

- Trainer: the launcher restarts it (failure policy), it resumes from the latest checkpoint, the
  groups it trained after that checkpoint (never acknowledged) come back and are trained again, and
  no step is repeated beyond what the checkpoint implies.
- Agent: the tickets it held are redelivered by the work queue and the run completes.
- nats-server (the run's own): the launcher restarts it on the same port and store; every role rides
  out the outage (no role restarts), no group is lost or trained twice, nothing traces on the terminal.
- Engine: the launcher restarts it; the agent gives its tickets back, waits, loads the current weights
  into the new engine, and the run completes with no group trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

from kuberl.runtime.bus.topology import DUPLICATE_WINDOW_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def start_run(manifest: Path, workdir: Path, bus_url: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kuberl run` on the session's nats-server, so the test can look into the bus."""
    log = open(workdir.parent / f"{workdir.name}.launcher.log", "w")
    return subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir), "--bus-url", bus_url],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def wait_for(predicate, timeout: float, what: str, run: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert run.poll() is None, f"the run ended early (code {run.returncode}) while waiting for {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def role_process(launcher_pid: int, role: str) -> psutil.Process:
    """The launcher's child running `kuberl <role>`."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "kuberl.cli" in cmd and role in cmd:
            return child
    raise AssertionError(f"no {role} process under the launcher")


def role_log_tails(workdir: Path, lines: int = 25) -> str:
    """The last lines of each role's log (workdir/logs), for a failure message: pytest's basetemp rotation deletes them."""
    out = []
    for log in sorted((workdir / "logs").glob("*.log")):
        tail = [x for x in log.read_text(errors="replace").splitlines() if "it/s]" not in x][-lines:]
        out.append(f"--- {log.name}\n" + "\n".join(x[:300] for x in tail))
    return "\n".join(out) or f"(no role logs under {workdir / 'logs'})"


def finish(run: subprocess.Popen, workdir: Path, timeout: float = 600) -> None:
    try:
        code = run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGINT)
        run.wait(timeout=60)
        raise AssertionError(f"the run did not finish after the fault\n{role_log_tails(workdir)}") from None
    log = (workdir.parent / f"{workdir.name}.launcher.log").read_text()
    assert code == 0, log[-4000:]
    assert processes_mentioning(str(workdir)) == []


def test_a_trainer_killed_mid_run_resumes_from_its_checkpoint_and_retrains_unsaved_groups(tmp_path, nats_server, experiment_name):
    steps, every = 14, 5
    manifest = quickstart_manifest(tmp_path, experiment_name, **{
        "training.totalSteps": steps, "checkpoint.everySteps": every, "failurePolicy.backoffSeconds": 1})
    workdir = tmp_path / "work"
    # A dedupe window far shorter than the restart takes: the restarted trainer must not rely on the bus
    # dropping the ticket ids it issued before the crash (in production: a restart more than 1 h later).
    run = start_run(manifest, workdir, nats_server.url, env={DUPLICATE_WINDOW_ENV: "1"})
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= every + 2, 420, f"step {every + 2}", run)
        before = read_metrics(workdir)
        role_process(run.pid, "trainer").kill()  # SIGKILL: no chance to checkpoint or ack
        finish(run, workdir)
    finally:
        if run.poll() is None:
            run.kill()
    rows = read_metrics(workdir)
    # After the restart, training resumes at the step after the checkpoint (every=5), not at 1 and not
    # after the crash: steps every+1..before[-1]["step"] (the crash) appear twice, nothing else does.
    steps_seen = [r["step"] for r in rows]
    resumed = steps_seen[len(before):]
    assert resumed[0] == every + 1, steps_seen
    assert resumed[-1] == steps and resumed == list(range(every + 1, steps + 1))
    # No acknowledged trajectory is lost: every group trained before the crash is in the final
    # history (steps up to the checkpoint kept their groups; later ones were redelivered and retrained).
    final = {}
    for r in rows:
        final[r["step"]] = r  # the last record of each step is the one the model kept
    kept = {g for r in final.values() for g in r["group_ids"]}
    trained_before = {g for r in before for g in r["group_ids"]}
    lost = trained_before - kept
    assert not lost, f"{len(lost)} groups trained before the crash are missing after it: {sorted(lost)[:5]}"
    # ... and none is trained twice: tickets issued before the crash were not rolled out again.
    kept_list = [g for r in final.values() for g in r["group_ids"]]
    twice = sorted({g for g in kept_list if kept_list.count(g) > 1})
    assert not twice, f"{len(twice)} groups trained twice in the final history: {twice[:5]}"
    saved = {g for r in before if r["step"] <= every for g in r["group_ids"]}
    assert saved <= {g for s, r in final.items() if s <= every for g in r["group_ids"]}
    # The restarted trainer did not publish again the tickets it had issued after the checkpoint (the
    # 1 s dedupe window no longer hides a repeat). A kill between publishing a batch and recording it
    # in KV `tickets` may repeat that one batch (at most B); without the catch-up it is every ticket
    # issued between the checkpoint and the crash (here >= 2 batches).
    batch = yaml.safe_load(manifest.read_text())["spec"]["algorithm"]["batchSize"]
    published, issued = asyncio.run(tickets_published(nats_server.url, manifest))
    assert published - issued <= batch, f"{published} tickets published for {issued} issued: tickets were issued twice"


def test_an_agent_killed_while_holding_tickets_has_them_reissued(tmp_path, nats_server, experiment_name):
    steps = 25  # long enough after the kill for the tickets' ack_wait (30 s) to expire
    manifest = quickstart_manifest(tmp_path, experiment_name, **{"training.totalSteps": steps})
    workdir = tmp_path / "work"
    run = start_run(manifest, workdir, nats_server.url)
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= 2, 420, "step 2", run)
        held = 0
        for _ in range(40):  # catch the agent while it holds tickets (it always does while generating)
            held = asyncio.run(tickets_info(nats_server.url, manifest))["tickets_in_flight"]
            if held:
                break
            time.sleep(0.25)
        assert held > 0, "the agent should be holding tickets while it generates"
        role_process(run.pid, "rollout").kill()
        finish(run, workdir)
    finally:
        if run.poll() is None:
            run.kill()
    assert [r["step"] for r in read_metrics(workdir)][-1] == steps
    # The dead agent's tickets went back to the work queue and the restarted agent got them again.
    log = (workdir / "logs" / "rollout-0.log").read_text()
    redelivered = [line for line in log.splitlines() if "redelivered (delivery" in line]
    # (>= 1, not == held: a ticket may be acked in the instant between the count and the kill)
    assert redelivered, f"{held} tickets were held just before the kill; none came back"


def launcher_child(launcher_pid: int, needle: str) -> psutil.Process:
    """The launcher's (grand)child whose command line contains `needle` (nats-server, the vLLM server)."""
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if needle in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process running {needle} under the launcher")


def assert_each_group_trained_once(rows: list[dict], steps: int, batch: int) -> None:
    final = {r["step"]: r for r in rows}
    assert sorted(final) == list(range(1, steps + 1)), sorted(final)
    kept = [g for r in final.values() for g in r["group_ids"]]
    assert len(kept) == steps * batch and len(set(kept)) == len(kept), "a group was lost or trained twice"


def starts(log: Path) -> int:
    """How many times the launcher started the role that writes `log` (one '==>' line per start)."""
    return sum(line.startswith("==> ") for line in log.read_text().splitlines())


def test_the_runs_own_nats_server_killed_mid_run_is_restarted_and_nothing_is_lost(tmp_path, experiment_name):
    steps = 8
    manifest = quickstart_manifest(tmp_path, experiment_name, **{"training.totalSteps": steps})
    workdir = tmp_path / "work"
    launcher_log = tmp_path / "launcher.out"
    with open(launcher_log, "w") as out:  # the terminal: what a user sees
        run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= 3, 420, "step 3", run)
        server = launcher_child(run.pid, "nats-server")
        port = {c.laddr.port for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        server.kill()  # SIGKILL, mid-run: roles are pulling, publishing and acking
        code = run.wait(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    terminal = launcher_log.read_text()
    assert code == 0, terminal[-4000:]
    assert "nats-server (the bus) killed by SIGKILL; restarting it" in terminal and "nats-server is back" in terminal
    assert "Traceback" not in terminal and "Task was destroyed" not in terminal, terminal[-4000:]
    batch = yaml.safe_load(manifest.read_text())["spec"]["algorithm"]["batchSize"]
    assert_each_group_trained_once(read_metrics(workdir), steps, batch)
    # The roles rode the outage out: none of them was restarted.
    for role in ("trainer", "rollout-0", "engine-0"):
        assert starts(workdir / "logs" / f"{role}.log") == 1, f"{role} was restarted"
    assert processes_mentioning(str(workdir)) == []
    listening = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert not port & listening, "the restarted nats-server was left running"


def test_the_engine_killed_mid_generation_is_restarted_and_the_agent_reloads_the_current_weights(tmp_path, nats_server, experiment_name):
    steps = 8
    manifest = quickstart_manifest(tmp_path, experiment_name, **{"training.totalSteps": steps})
    workdir = tmp_path / "work"
    run = start_run(manifest, workdir, nats_server.url)
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= 3, 420, "step 3", run)
        held = 0
        for _ in range(40):  # mid-generation: the agent holds tickets
            held = asyncio.run(tickets_info(nats_server.url, manifest))["tickets_in_flight"]
            if held:
                break
            time.sleep(0.25)
        assert held > 0
        version_at_kill = read_metrics(workdir)[-1]["step"]
        launcher_child(run.pid, "vllm.entrypoints.openai.api_server").kill()
        finish(run, workdir)
    finally:
        if run.poll() is None:
            run.kill()
    batch = yaml.safe_load(manifest.read_text())["spec"]["algorithm"]["batchSize"]
    assert_each_group_trained_once(read_metrics(workdir), steps, batch)
    assert starts(workdir / "logs" / "engine-0.log") == 2 and starts(workdir / "logs" / "rollout-0.log") == 1
    agent_log = (workdir / "logs" / "rollout-0.log").read_text()
    assert "is not answering" in agent_log
    # The new engine started with the initial model: the agent loaded the trainer's current weights into it.
    back = [line for line in agent_log.splitlines() if "engine back after" in line]
    assert back and int(back[0].rsplit("serving v", 1)[1]) >= version_at_kill, back


def test_a_bus_that_cannot_come_back_stops_the_run_with_one_clear_line_and_exit_1(tmp_path, experiment_name):
    manifest = quickstart_manifest(tmp_path, experiment_name, **{"training.totalSteps": 500})
    workdir = tmp_path / "work"
    terminal_log = tmp_path / "launcher.out"
    with open(terminal_log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                               cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    blocker = socket.socket()
    try:
        # Kill it once the launcher follows progress over the bus (a read then rides out outages for minutes:
        # the launcher must still stop when the supervisor gives up, not when that read does).
        wait_for(lambda: re.search(r"^step \d+/500", terminal_log.read_text(), re.M), 420, "progress on the terminal", run)
        server = launcher_child(run.pid, "nats-server")
        port = next(c.laddr.port for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN)
        server.kill()
        server.wait(10)
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", port))  # something else took its port: it cannot come back there
        blocker.listen()
        code = run.wait(timeout=300)
    finally:
        blocker.close()
        if run.poll() is None:
            run.kill()
    terminal = terminal_log.read_text()
    assert code == 1, terminal[-3000:]
    failed = [line for line in terminal.splitlines() if line.startswith("kuberl run: failed:")]
    assert len(failed) == 1 and "nats-server (the bus) would not start again" in failed[0], terminal[-3000:]
    assert f"kuberl run --resume {workdir / 'experiment.yaml'} --workdir {workdir}" in failed[0]
    assert "Traceback" not in terminal and "Task was destroyed" not in terminal and "Event loop is closed" not in terminal
    assert processes_mentioning(str(workdir)) == []
    # The trainer, stopped while its step waited on the dead bus, exited at once rather than at the end of its grace.
    trainer_log = (workdir / "logs" / "trainer.log").read_text()
    assert "SIGTERM while the bus is down: exiting now" in trainer_log, trainer_log[-3000:]
    assert "Traceback" not in trainer_log, trainer_log[-3000:]


async def tickets_info(bus_url: str, manifest: Path) -> dict[str, int]:
    """The ticket work queue's counts, read from the bus the run uses."""
    from kuberl.api import load_experiment
    from kuberl.runtime.bus import Bus

    bus = await Bus.connect(bus_url, load_experiment(manifest).name, create=False)
    try:
        return await bus.stream_info()
    finally:
        await bus.close()


async def tickets_published(bus_url: str, manifest: Path) -> tuple[int, int]:
    """(tickets ever published on the run's stream, tickets the trainer's book says it issued)."""
    from kuberl.api import load_experiment
    from kuberl.runtime.bus import Bus
    from kuberl.runtime.bus.names import KEY_TICKETS

    bus = await Bus.connect(bus_url, load_experiment(manifest).name, create=False)
    try:
        info = await bus.js.stream_info(bus.names.tickets_stream)
        return info.state.last_seq, (await bus.get_state(KEY_TICKETS))["issued"]
    finally:
        await bus.close()


def test_ctrl_c_stops_every_role_and_the_bus_it_started(tmp_path):
    manifest = quickstart_manifest(tmp_path, "ctrl-c", **{"training.totalSteps": 500})
    workdir = tmp_path / "work"
    log = open(tmp_path / "launcher.log", "w")
    # Started with SIGINT ignored, as a non-interactive shell starts a command with `&` (CI scripts): Ctrl-C must stop it anyway.
    run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= 2, 420, "step 2", run)
        children = psutil.Process(run.pid).children(recursive=True)
        ports = {c.laddr.port for p in children for c in _connections(p) if c.status == psutil.CONN_LISTEN}
        assert any("nats-server" in " ".join(p.cmdline()) for p in children) and ports
        run.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
        assert run.wait(timeout=120) == 130
        left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if run.poll() is None:
            run.kill()
        for p in locals().get("children", []):  # checked above; never leave a failed run's roles to the next tests
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert left == []
    # Roles started after the snapshot (a restarted engine, anything a role spawned late) carry the run's KUBERL_WORKDIR.
    assert _processes_of_run(workdir) == []
    out = (tmp_path / "launcher.log").read_text()
    assert "interrupted; stopping every role" in out and "Traceback" not in out, out[-2000:]
    # A port the run freed may be taken at once by the other xdist worker's tests (they bind free ports too): a listener
    # under another pytest process is theirs. One under this test's process, or orphaned (the launcher is gone), is the run's.
    still = {c.laddr.port: c.pid for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
    leaked = {port: _describe(pid) for port, pid in still.items() if not _under_another_pytest(pid)}
    assert not leaked, f"ports still listening after Ctrl-C: {leaked}"


def _processes_of_run(workdir: Path) -> list[str]:
    """Live processes whose environment names `workdir` as KUBERL_WORKDIR (every role the launcher starts has it)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get("KUBERL_WORKDIR") == str(workdir):
                found.append(_describe(p.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _under_another_pytest(pid: int | None) -> bool:
    """Whether process `pid` is, or runs under, a pytest process other than this test's own (the other xdist worker)."""
    if pid is None:
        return False  # owner unknown: count it as the run's
    try:
        for p in [psutil.Process(pid), *psutil.Process(pid).parents()]:
            if p.pid == os.getpid():
                return False
            if "pytest" in " ".join(p.cmdline()) or "execnet" in " ".join(p.cmdline()):
                return True
    except psutil.NoSuchProcess:
        return True  # exited since: it holds no port now
    except psutil.AccessDenied:
        return False
    return False


def _describe(pid: int | None) -> str:
    try:
        return f"pid {pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}" if pid else "pid unknown"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {pid}"


def _connections(p: psutil.Process) -> list:
    try:
        return p.net_connections("inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
