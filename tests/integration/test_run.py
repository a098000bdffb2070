"""`kuberl run` end to end: the real launcher, nats-server, vLLM CPU engine, rollout agent and trainer.

One short run of the quickstart task (shared by the tests of this module) must learn, be off-policy
within the staleness bound and drop (almost) nothing, write its metrics and plot, and leave no process
behind. A second, synchronous run (eta = 0, weights through the bus) must drop no group at all: agents
start a ticket only on the weights it was issued at.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 80
ETA = 2
SYNC_STEPS = 12
BATCH = 16  # examples/quickstart.yaml's batchSize


def quickstart_manifest(tmp: Path, name: str, **spec_overrides) -> Path:
    """The quickstart manifest with a new name and a few fields replaced (dotted keys)."""
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    for dotted, value in spec_overrides.items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def read_metrics(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and any(text in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def role_of(cmdline: list[str]) -> str | None:
    """Which part of a `kuberl run` a process is, from its command line (None: the launcher's helpers)."""
    text = " ".join(cmdline)
    if cmdline and Path(cmdline[0]).name == "nats-server":
        return "nats-server"
    for role in ("engine", "rollout", "trainer"):
        if f"kuberl.cli {role} " in text:
            return role
    if "vllm" in text.lower():  # the engine's server (exec'd by `kuberl.cli engine`) and its engine-core child
        return "engine"
    return None


def scheduling_policies(root: psutil.Process) -> dict[str, set[int]]:
    """The Linux scheduling policy of every thread under `root`, by role."""
    found: dict[str, set[int]] = {}
    for p in root.children(recursive=True):
        try:
            role = role_of(p.cmdline())
            if role is not None:
                found.setdefault(role, set()).update(os.sched_getscheduler(t.id) for t in p.threads())
        except (psutil.Error, OSError):  # a process or thread that ended meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def short_run_and_policies(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, dict[str, set[int]]]:
    """The short run, and the scheduling policies of its processes' threads seen once it trains (step 3)."""
    tmp = tmp_path_factory.mktemp("run")
    manifest = quickstart_manifest(tmp, "it-learns", **{"training.totalSteps": STEPS, "staleness.maxHeadOffpolicyness": ETA})
    workdir = tmp / "work"
    args = [sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)]
    out, err = tmp / "stdout", tmp / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=o, stderr=e, text=True)
    policies: dict[str, set[int]] = {}
    try:
        while proc.poll() is None:
            if not policies and len(read_metrics(workdir)) >= 3:
                policies = scheduling_policies(psutil.Process(proc.pid))
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text()), workdir, policies
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def short_run(short_run_and_policies) -> tuple[subprocess.CompletedProcess, Path]:
    return short_run_and_policies[:2]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("sync")
    manifest = quickstart_manifest(tmp, "sync-bus", **{"training.totalSteps": SYNC_STEPS, "staleness.maxHeadOffpolicyness": 0,
                                                       "weightSync.mode": "bus", "checkpoint.everySteps": 100})
    workdir = tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    return proc, workdir


def test_the_run_finishes_every_step_and_exits_zero(short_run):
    proc, workdir = short_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [m["step"] for m in read_metrics(workdir)]
    assert steps == list(range(1, STEPS + 1))


def test_the_reward_rises_over_the_run(short_run):
    _, workdir = short_run
    rewards = [m["reward_mean"] for m in read_metrics(workdir)]
    # Measured here: ~0.003 over the first 10 steps, ~0.4 over steps 71-80 (and >0.9 by step 130).
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert first < 0.1 and last > first + 0.2, f"mean reward went from {first:.3f} to {last:.3f}"


def test_every_step_publishes_a_new_policy_version(short_run):
    _, workdir = short_run
    versions = [m["policy_version"] for m in read_metrics(workdir)]
    assert versions == sorted(versions) and versions[-1] >= STEPS
    assert (workdir / "weights").is_dir() and any((workdir / "weights").iterdir())


def test_async_training_is_off_policy_within_the_bound_and_trains_every_group(short_run):
    _, workdir = short_run
    rows = read_metrics(workdir)
    # With eta = 2 the agents run up to two batches ahead of the trainer: trained samples lag on average.
    later = rows[5:]
    mean = sum(m["staleness_mean"] for m in later) / len(later)
    assert 0 < mean <= ETA, f"mean staleness {mean:.2f} over steps 6-{STEPS} (trainer waited {sum(m['wait_seconds'] for m in rows):.0f}s)"
    # staleness.dropStaleGroups is off: every group is trained, none dropped. Tickets wait for the weights they were
    # issued at, so a group lags more than eta only as a straggler issued at v that arrives after the trainer passed
    # v + eta; it is trained and counted in over_stale, in exactly the steps whose staleness_max exceeds eta.
    # Measured here when such groups were dropped: 23 of 1280 (1.8%). The strict check (0) is the synchronous run below.
    assert rows[-1]["dropped_stale"] == 0
    over = [m["over_stale"] for m in rows]
    grew = [now > before for before, now in zip([0, *over], over)]
    assert [m["staleness_max"] > ETA for m in rows] == grew, list(zip([m["staleness_max"] for m in rows], over))
    assert over[-1] <= 0.05 * STEPS * BATCH, f"{over[-1]} groups trained over the bound in {STEPS} steps of {BATCH}"
    assert rows[-1]["failed_groups"] == 0


def test_every_step_logs_the_policy_entropy(short_run):
    _, workdir = short_run
    entropies = [m["entropy"] for m in read_metrics(workdir)]
    assert len(entropies) == STEPS and all(0 < e < 10 for e in entropies), entropies[:5]


def test_synchronous_training_drops_no_group_when_agents_honour_ticket_versions(sync_run):
    # eta = 0 with weights through the bus: each step's tickets are issued at the version just published,
    # while the agent is still downloading it. A ticket started on the old weights would be dropped.
    proc, workdir = sync_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(workdir)
    assert [m["step"] for m in rows] == list(range(1, SYNC_STEPS + 1))
    assert rows[-1]["dropped_stale"] == 0, f"{rows[-1]['dropped_stale']} groups dropped as stale at eta 0"
    assert rows[-1]["over_stale"] == 0, f"{rows[-1]['over_stale']} groups trained on weights older than the bound at eta 0"
    assert all(m["staleness_max"] == 0 for m in rows)


def test_the_run_leaves_a_reward_plot_and_checkpoints(short_run):
    _, workdir = short_run
    png = workdir / "reward.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((workdir / "checkpoints").glob("step-*"))


def test_the_rollout_side_runs_under_sched_batch_and_the_trainer_does_not(short_run_and_policies):
    """kuberl.runtime.resources.batch_scheduling: the engine (server and engine core), the agent and nats-server, every
    thread, under SCHED_BATCH, so that they do not preempt the trainer's update on the cores they share with it."""
    _, _, policies = short_run_and_policies
    assert set(policies) == {"engine", "rollout", "trainer", "nats-server"}, policies
    for role in ("engine", "rollout", "nats-server"):
        assert policies[role] == {os.SCHED_BATCH}, (role, policies[role])
    assert policies["trainer"] == {os.SCHED_OTHER}


def test_no_process_of_the_run_survives_it(short_run):
    _, workdir = short_run
    assert processes_mentioning(str(workdir)) == []


def test_a_backend_admission_refuses_stops_kuberl_run_before_any_process_starts(tmp_path):
    """trainer.backend megatron with context and expert parallel together is refused by the model (as by admission: context parallel of a MoE
    model is not implemented): exit 2, the reason naming the field, and no role ever started."""
    from kuberl.api.v1alpha1 import MEGATRON_CONTEXT_EXPERT

    manifest = quickstart_manifest(tmp_path, "bad-backend", **{"trainer.backend": "megatron", "trainer.parallelism.context": 2,
                                                              "trainer.parallelism.expert": 2})
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "is not a valid RLExperiment" in proc.stderr and MEGATRON_CONTEXT_EXPERT in proc.stderr
    assert not (workdir / "logs").exists() and processes_mentioning(str(workdir)) == []


def test_a_configuration_error_stops_the_run_at_once_with_the_reason_and_exit_code_2(tmp_path):
    """A role exits 2 (a data set whose rows lack dataset.promptField: trainer and agents both read it):
    no restart under the failure policy, the reason from its termination message on stderr, every role stopped."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(8)))
    manifest = quickstart_manifest(tmp_path, "bad-data", **{"dataset": {"path": str(data)}, "failurePolicy.maxRestarts": 5})
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\S+ stopped on a configuration error \(exit 2\): dataset.path \S+: row 0 has no field 'question' "
                     r"\(dataset.promptField\)", proc.stderr), proc.stderr[-3000:]
    assert (workdir / "logs" / "trainer.log").read_text().count("==> ") <= 1, "the trainer must not be restarted"
    assert processes_mentioning(str(workdir)) == []
