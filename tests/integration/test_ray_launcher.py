"""`kuberl run FILE --ray ADDRESS` on a real local Ray cluster (started on loopback by the test).

The quickstart, shortened, runs with every role (nats-server, vLLM CPU engine, rollout agent,
trainer) as a process under a Ray actor: it must learn as the local quickstart does (the bar of
test_run.py), survive the rollout agent being killed mid-run (the supervisor restarts it through a
Ray actor, the run finishes with exit 0), and leave no role process and no actor behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

from kuberl.executables import installed_executable
from kuberl.net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 80
KILL_AT = 20
# Ray resolves 127.0.0.1 to the machine's outward address unless told it is a one-machine cluster:
# keep every Ray process, and so every role's address, on loopback.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A one-node Ray cluster on loopback (`ray start --head --block` in a session of its own), stopped by
    SIGTERM to its leader, then SIGKILL to what is left of that session: never another Ray of this machine."""
    ray_bin = installed_executable("ray") or pytest.fail("the ray CLI is missing: bash scripts/setup.sh installs kuberl-runtime[ray]")
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    out = temp / "ray-start.log"
    with open(out, "w") as log:
        head = subprocess.Popen([ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
                                 "--num-cpus", "2", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(temp)],
                                env={**os.environ, **RAY_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in out.read_text():
            assert head.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", temp
    finally:
        head.send_signal(signal.SIGTERM)  # the head drains and stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == head.pid:
                    p.kill()
            except (OSError, psutil.NoSuchProcess):
                pass


def role_process(workdir: Path, command: str) -> psutil.Process:
    """The `kuberl <command>` process of this run (a child of a Ray worker, not of the launcher)."""
    for p in processes_mentioning(str(workdir)):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "kuberl.cli" in cmd and command in cmd:
            return p
    raise AssertionError(f"no kuberl {command} process of {workdir}")


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory: pytest.TempPathFactory):
    address, _ = ray_cluster
    tmp = tmp_path_factory.mktemp("rayrun")
    manifest = quickstart_manifest(tmp, "ray-learns", **{"training.totalSteps": STEPS, "staleness.maxHeadOffpolicyness": 2})
    workdir = tmp / "work"
    out = tmp / "launcher.out"
    with open(out, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir), "--ray", address],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
    killed = None
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(workdir)) < KILL_AT:
            assert run.poll() is None, f"the run ended early (code {run.returncode}): {out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no step {KILL_AT} after 300 s: {out.read_text()[-3000:]}"
            time.sleep(0.5)
        agent = role_process(workdir, "rollout")
        killed = agent.pid
        agent.send_signal(signal.SIGKILL)
        code = run.wait(timeout=400)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
    return code, out.read_text(), workdir, killed


def test_the_quickstart_learns_on_ray_and_survives_a_killed_agent(ray_run):
    code, terminal, workdir, killed = ray_run
    assert code == 0, terminal[-4000:]
    assert "on the Ray head node" in terminal and "on Ray (127.0.0.1:" in terminal, terminal[-3000:]
    # The agent died under its actor and the supervisor brought it back, as the local launcher does.
    assert "rollout-0 killed by SIGKILL; restarting it" in terminal, terminal[-3000:]
    agent_log = (workdir / "logs" / "rollout-0.log").read_text()
    assert agent_log.count("==> ") == 2 and "(Ray node 127.0.0.1)" in agent_log, agent_log[-2000:]
    rows = read_metrics(workdir)
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    rewards = [m["reward_mean"] for m in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.1 and last > first + 0.2, f"mean reward went from {first:.3f} to {last:.3f}"


def test_every_role_ran_under_a_ray_worker_and_none_survives_the_run(ray_run, ray_cluster):
    code, terminal, workdir, killed = ray_run
    # Each role log was written by a Ray actor's subprocess on the (loopback) node, the bus's too.
    for role in ("nats-server", "engine-0", "rollout-0", "trainer"):
        text = (workdir / "logs" / f"{role}.log").read_text()
        assert "(Ray node 127.0.0.1)" in text, f"{role}: {text[-1000:]}"
    assert processes_mentioning(str(workdir)) == []
    assert live_actors(ray_cluster[0]) == 0


def live_actors(address: str) -> int:
    """Actors alive (or coming up) on the cluster, read from its GCS by a separate driver."""
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
                            "import ray._private.state as s; "
                            "print(sum(a['State'] in ('ALIVE', 'PENDING_CREATION', 'RESTARTING') for a in s.actors().values()))"],
                           env={**os.environ, **RAY_ENV}, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return int(probe.stdout.strip().splitlines()[-1])


def test_ctrl_c_stops_every_actor_and_role_process(ray_cluster, tmp_path):
    address, _ = ray_cluster
    manifest = quickstart_manifest(tmp_path, "ray-ctrl-c", **{"training.totalSteps": 500})
    workdir = tmp_path / "work"
    out = tmp_path / "launcher.out"
    with open(out, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir), "--ray", address],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(workdir)) < 3:
            assert run.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        assert live_actors(address) == 4  # one actor per role process: nats-server, engine-0, rollout-0, trainer
        run.send_signal(signal.SIGINT)
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert code == 130, out.read_text()[-3000:]
    assert "interrupted; stopping every role" in out.read_text()
    assert processes_mentioning(str(workdir)) == []
    assert live_actors(address) == 0


def test_ray_without_a_cluster_says_so_and_exits_2(tmp_path):
    manifest = quickstart_manifest(tmp_path, "no-cluster", **{"training.totalSteps": 2})
    dead = f"127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(tmp_path / "w"), "--ray", dead],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, **RAY_ENV})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"cannot reach the Ray cluster at --ray {dead}" in proc.stderr


def test_a_launcher_killed_with_sigkill_leaves_no_role_process_and_no_actor(ray_cluster, tmp_path):
    """Ray kills the actors of a driver that is gone; each role's life hangs on its actor's (RoleActor's lifeline), and
    what a role started on its own (the bus's nats-server, the engine's engine core) on the role's."""
    address, _ = ray_cluster
    manifest = quickstart_manifest(tmp_path, "ray-kill-9", **{"training.totalSteps": 500})
    workdir = tmp_path / "work"
    out = tmp_path / "launcher.out"
    with open(out, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir), "--ray", address],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(workdir)) < 2:
            assert run.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        roles = processes_mentioning(str(workdir))  # the role commands; under them nats-server and vLLM's engine core
        procs = [*roles, *(c for p in roles for c in p.children(recursive=True))]
        assert any("nats-server" in " ".join(p.cmdline()) for p in procs), [p.cmdline() for p in procs]
        run.kill()
        run.wait()
        t0 = time.monotonic()
        while (left := [p.pid for p in procs if _running(p)]) and time.monotonic() - t0 < 60:  # Ray notices in seconds
            time.sleep(0.2)
        took = time.monotonic() - t0
        left = [f"pid {p.pid}: {' '.join(p.cmdline())[:200]}" for p in procs if p.pid in left and _running(p)]
    finally:
        if run.poll() is None:
            run.kill()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert left == []
    assert processes_mentioning(str(workdir)) == []
    assert live_actors(address) == 0
    print(f"{len(procs)} role processes, all gone {took:.1f}s after the launcher's SIGKILL")


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie (re-parented to init, a killed process may stay one for a while)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
