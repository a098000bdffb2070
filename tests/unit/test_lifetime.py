"""Nothing `kuberl run` starts outlives it (kuberl.runtime.lifetime): a launcher killed with SIGKILL takes its roles and
everything they started along within GRACE seconds, by each layer alone (the guard, the watchdogs, the parent-death
signal); a role's process forked or spawned from a watched one ends with it (vLLM's engine core, torchrun's ranks); and
stopping a run is bounded whatever its roles do with SIGTERM.

The "launcher" here is a small script (LAUNCHER) that starts stand-in roles as `kuberl run` does; each role forks a
child (as vLLM forks its engine core), spawns one in its group and one in a session of its own, and writes their pids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kuberl.runtime import lifetime
from kuberl.runtime.launcher import LocalRun
from kuberl.runtime.lifetime import LIFELINE_ENV, POLL_SECONDS

GRACE = 4 * POLL_SECONDS + 2.0
"""How long a process of a killed launcher may outlive it here: a few watchdog polls, and a slow machine's scheduling."""

ROLE = r"""
import json, os, subprocess, sys, time
if sys.argv[2] == "watch":
    from kuberl.runtime.lifetime import watch_parent
    watch_parent()
pids = {"role": os.getpid()}
if sys.argv[3] == "fork":
    child = os.fork()
    if child == 0:  # vLLM's engine core: forked, no exec
        time.sleep(600)
        os._exit(0)
    pids["forked"] = child
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
pids["spawned"] = subprocess.Popen(sleep).pid  # a worker started in the role's group
pids["own-session"] = subprocess.Popen(sleep, start_new_session=True).pid  # one that left it (only the guard finds it)
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(pids, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

LAUNCHER = r"""
import json, os, sys, threading, time
from pathlib import Path
from kuberl.runtime.launcher import Role
from kuberl.runtime.lifetime import Lifeline
out, guard, thread, watch, fork = Path(sys.argv[1]), *(a == "1" for a in sys.argv[2:6])
lifeline = Lifeline()
if guard:
    lifeline.start_guard()
    (out / "guard.json").write_text(json.dumps({"guard": lifeline.guard.pid}))
roles = [Role(f"role-{i}", [sys.executable, "-c", sys.argv[6], str(out / f"role-{i}.json"), "watch" if watch else "no",
                            "fork" if fork else "no"],
              dict(os.environ), out / f"role-{i}.log", lifeline=lifeline) for i in range(2)]
def start():
    for role in roles:
        role.start()
if thread:  # started from a thread that ends at once: no parent-death signal (it would come with the thread's end)
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
if len(sys.argv) > 7:  # the run's own nats-server, tied as `kuberl run` ties it
    from kuberl.runtime.bus.server import start_nats_server
    server = start_nats_server(store_dir=str(out / "store"), lifeline=lifeline)
    (out / "nats.json").write_text(json.dumps({"nats-server": server.pid}))
print("started", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: dict[str, int], seconds: float) -> dict[str, int]:
    """The processes of `pids` still alive after `seconds` (sooner when none is)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.05)
    return {name: pid for name, pid in pids.items() if alive(pid)}


def wait_file(path: Path, proc: subprocess.Popen, seconds: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, f"exited with {proc.returncode} before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} after {seconds}s"
        time.sleep(0.05)
    return json.loads(path.read_text())


def kill_all(pids: dict[str, int]) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(tmp_path: Path, *, guard: bool, thread: bool, watch: bool, fork: bool = True,
           nats: bool = False) -> tuple[subprocess.Popen, dict[str, int]]:
    """The launcher, and the pids of everything it started (its roles' children included) once all are up."""
    args = [sys.executable, "-c", LAUNCHER, str(tmp_path), *("1" if x else "0" for x in (guard, thread, watch, fork)), ROLE]
    proc = subprocess.Popen(args + (["nats"] if nats else []), stdout=subprocess.PIPE, start_new_session=True)
    pids: dict[str, int] = {}
    try:
        for i in range(2):
            pids.update({f"{k}-{i}": v for k, v in wait_file(tmp_path / f"role-{i}.json", proc).items()})
        if guard:
            pids.update(wait_file(tmp_path / "guard.json", proc))
        if nats:
            pids.update(wait_file(tmp_path / "nats.json", proc))
        assert proc.stdout.readline() == b"started\n"
    except BaseException:
        proc.kill()
        kill_all(pids)
        raise
    return proc, pids


@pytest.mark.parametrize("guard, thread, watch, fork", [
    (True, False, True, True), (True, True, False, True), (False, True, True, True), (False, False, True, False)],
    ids=["every layer", "the guard alone", "the watchdogs alone", "no guard, as a Ray actor's roles (kuberl bus and its nats-server)"])
def test_everything_a_launcher_killed_with_sigkill_started_is_gone_within_the_grace(tmp_path, guard, thread, watch, fork):
    proc, pids = launch(tmp_path, guard=guard, thread=thread, watch=watch, fork=fork, nats=guard and not thread)
    if not guard:  # a process that left the role's session is the guard's to find: without it, not this test's
        kill_all({k: v for k, v in pids.items() if k.startswith("own-session")})
        pids = {k: v for k, v in pids.items() if not k.startswith("own-session")}
    try:
        assert all(alive(p) for p in pids.values())
        proc.kill()
        proc.wait()
        left = wait_gone(pids, GRACE)
    finally:
        kill_all(pids)
    assert left == {}, f"outlived their launcher by {GRACE:.1f}s: {left}"


def test_the_parent_death_signal_alone_ends_each_role_started_from_the_launchers_main_thread(tmp_path):
    proc, pids = launch(tmp_path, guard=False, thread=False, watch=False)
    leaders = {k: v for k, v in pids.items() if k.startswith("role-")}
    try:
        proc.kill()
        proc.wait()
        left = wait_gone(leaders, GRACE)
    finally:
        kill_all(pids)
    assert left == {}


def test_a_roles_watchdog_kills_its_whole_group_when_the_launcher_is_gone_and_says_so(tmp_path):
    proc, pids = launch(tmp_path, guard=False, thread=True, watch=True)
    try:
        proc.kill()
        proc.wait()
        assert wait_gone({k: v for k, v in pids.items() if not k.startswith("own-session")}, GRACE) == {}
    finally:
        kill_all(pids)
    assert "its launcher is gone; killing its process group" in (tmp_path / "role-0.log").read_text()


def test_a_process_forked_or_spawned_by_a_watched_one_ends_when_it_dies_as_vllms_engine_core_and_torchruns_ranks_do(tmp_path):
    """In a pod there is no launcher: a role's own children watch their parent (the role itself is the container's
    main process). Here the role is killed alone; its forked child and a spawned one that watches follow it."""
    script = ROLE.replace('"spawned"] = subprocess.Popen(sleep)', '"spawned"] = subprocess.Popen([sys.executable, "-c", '
                          '"from kuberl.runtime.lifetime import watch_parent; watch_parent(); import time; time.sleep(600)"])')
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "role.json"), "watch", "fork"], start_new_session=True)
    pids = wait_file(tmp_path / "role.json", proc)
    pids.pop("own-session")
    try:
        proc.kill()
        proc.wait()
        left = wait_gone(pids, GRACE)
    finally:
        kill_all(pids)
    assert left == {}


WATCHED = "from kuberl.runtime.lifetime import watch_parent; watch_parent(); import os, sys, time; print(os.getpid(), flush=True); time.sleep(600)"


def test_a_watchdog_in_a_group_that_is_not_its_roles_kills_only_its_own_process(tmp_path):
    """A role started in its caller's group (a test, a shell) must not take the caller's group down with it."""
    # A stand-in shell leads the group; under it a parent, under that the watched process: all three in the shell's group.
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {WATCHED!r}]); time.sleep(600)"
    shell = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {parent!r}]); "
                              "time.sleep(600)"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        watched = int(shell.stdout.readline())
        assert os.getpgid(watched) == shell.pid != watched
        psutil.Process(watched).parent().kill()
        assert wait_gone({"watched": watched}, GRACE) == {}
        time.sleep(0.5)
        assert alive(shell.pid), "the watchdog killed a group that was not its role's"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_a_lifeline_is_recognised_by_its_pipe_not_by_a_file_on_the_same_number(tmp_path, monkeypatch):
    line = lifetime.Lifeline()
    try:
        monkeypatch.setenv(LIFELINE_ENV, line.value)
        assert lifetime._lifeline_fd() == line.read_fd
        with open(tmp_path / "f", "w") as f:  # a process that closed it, the number then reused for another file
            fd, _, token = line.value.split(":")
            monkeypatch.setenv(LIFELINE_ENV, f"{f.fileno()}:{os.fstat(int(fd)).st_ino}:{token}")
            assert lifetime._lifeline_fd() is None
        monkeypatch.delenv(LIFELINE_ENV)
        assert lifetime._lifeline_fd() is None  # not started by a launcher (a pod): the parent alone tells
    finally:
        line.close()


def make_run(tmp_path: Path, script: str) -> LocalRun:
    from kuberl.api import RLExperiment

    exp = RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "t"}, "spec": {
        "model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "training": {"totalSteps": 3},
        "rollout": {"engine": "vllm", "replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
        "trainer": {"accelerator": {"type": "cpu", "count": 1}}}})
    run = LocalRun(exp, tmp_path / "e.yaml", tmp_path, "nats://127.0.0.1:1")
    run.plan(gpus=0)
    for role in run.roles:
        role.argv = [sys.executable, "-c", script]
    return run


STUBBORN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
            "print('up', flush=True); time.sleep(600)")


def started(run: LocalRun) -> list[psutil.Process]:
    """Every process of the run's roles, once each role and its child are up."""
    for role in run.roles:
        role.start()
    deadline = time.monotonic() + 60
    while any("\nup\n" not in r.log_path.read_text() for r in run.roles):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return [p for r in run.roles for p in [psutil.Process(r.proc.pid), *psutil.Process(r.proc.pid).children(recursive=True)]]


def test_stopping_a_run_whose_roles_ignore_sigterm_kills_them_all_after_the_grace(tmp_path):
    run = make_run(tmp_path, STUBBORN)
    procs = started(run)
    assert len(procs) == 2 * len(run.roles)
    t0 = time.monotonic()
    run.stop_all(grace=1.0)
    took = time.monotonic() - t0
    left = wait_gone({str(p.pid): p.pid for p in procs}, 1.0)  # SIGKILLed: gone as soon as the kernel has run them
    kill_all(left)
    assert left == {} and took < 1.0 + 2.0  # all roles at once: one grace, not one per role


def test_a_second_signal_while_stopping_kills_what_is_left_at_once(tmp_path):
    run = make_run(tmp_path, STUBBORN)
    procs = started(run)
    run.hurry = True  # what the launcher's handler sets on a second Ctrl-C or SIGTERM
    t0 = time.monotonic()
    run.stop_all(grace=60.0)
    assert time.monotonic() - t0 < 3.0
    assert wait_gone({str(p.pid): p.pid for p in procs}, 1.0) == {}


def test_roles_that_stop_on_sigterm_do_not_wait_for_the_grace(tmp_path):
    run = make_run(tmp_path, "import time; print('up', flush=True); time.sleep(600)")
    procs = started(run)
    t0 = time.monotonic()
    run.stop_all(grace=60.0)
    assert time.monotonic() - t0 < 3.0
    assert wait_gone({str(p.pid): p.pid for p in procs}, 1.0) == {}


def test_the_nats_server_of_kuberl_bus_dies_with_it_however_it_ends(tmp_path):
    """`kuberl bus` (a pod's bus, or a Ray actor's) SIGKILLed: no time to stop its nats-server, which dies with it anyway."""
    from kuberl.net import free_port

    bus = subprocess.Popen([sys.executable, "-m", "kuberl.cli", "bus", "--port", str(free_port()), "--store-dir", str(tmp_path / "store")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = bus.stdout.readline().decode()  # its log line: "... nats-server pid N listening on ..."
        server = int(line.split("nats-server pid ")[1].split()[0])
        assert alive(server)
        bus.kill()
        bus.wait()
        left = wait_gone({"nats-server": server}, GRACE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bus.pid, signal.SIGKILL)
    kill_all(left)
    assert left == {}


def test_a_role_that_execs_another_program_hands_it_the_parent_death_signal_back(tmp_path):
    """`kuberl engine` runs the watchdog (which takes the parent-death signal over), then execs the engine's server, which
    may start no watchdog of its own (vLLM without KubeRL's wrapper): killed with the launcher all the same."""
    role = ("import os, sys; from kuberl.runtime.lifetime import before_exec, watch_parent; watch_parent(); before_exec(); "
            "os.execv(sys.executable, [sys.executable, '-c', 'import time; print(\"up\", flush=True); time.sleep(600)'])")
    launcher = ("import subprocess, sys, time; from kuberl.runtime.lifetime import Lifeline; line = Lifeline(); "
                f"p = subprocess.Popen([sys.executable, '-c', {role!r}], env=line.env(), **line.popen_kwargs()); "
                "print(p.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, start_new_session=True)
    server = int(proc.stdout.readline())
    try:
        assert proc.stdout.readline() == b"up\n"  # the role has exec'd the "server"
        proc.kill()
        proc.wait()
        left = wait_gone({"server": server}, GRACE)
    finally:
        kill_all({"server": server})
    assert left == {}
