"""`kuberl run` end to end: the real launcher, nats-server, vLLM CPU engine, rollout agent and trainer.

One short run of the quickstart task (shared by the tests of this module) must learn, respect the
staleness bound, write its metrics and plot, and leave no process behind.
"""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("run")
    manifest = quickstart_manifest(tmp, "it-learns", **{"training.totalSteps": STEPS, "staleness.maxHeadOffpolicyness": ETA})
    workdir = tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
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


def test_no_trained_sample_is_older_than_the_staleness_bound(short_run):
    _, workdir = short_run
    rows = read_metrics(workdir)
    assert all(m["staleness_max"] <= ETA for m in rows), [m["staleness_max"] for m in rows]
    assert any(m["staleness_max"] > 0 for m in rows), "eta > 0 should let some off-policy samples through (async)"


def test_the_run_leaves_a_reward_plot_and_checkpoints(short_run):
    _, workdir = short_run
    png = workdir / "reward.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((workdir / "checkpoints").glob("step-*"))


def test_no_process_of_the_run_survives_it(short_run):
    _, workdir = short_run
    assert processes_mentioning(str(workdir)) == []


def test_a_configuration_error_stops_the_run_at_once_with_the_reason_and_exit_code_2(tmp_path):
    """The trainer exits 2 (trainer.backend megatron): no restart under the failure policy, the reason
    from its termination message on stderr, every role stopped."""
    manifest = quickstart_manifest(tmp_path, "bad-backend", **{"trainer.backend": "megatron", "failurePolicy.maxRestarts": 5})
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainer stopped on a configuration error (exit 2): trainer.backend 'megatron' is not implemented" in proc.stderr
    assert (workdir / "logs" / "trainer.log").read_text().count("==> ") == 1, "the trainer must not be restarted"
    assert processes_mentioning(str(workdir)) == []
