"""`kuberl run` of examples/lora-cpu.yaml: LoRA end to end through the real launcher, nats-server, vLLM CPU engine
(--enable-lora), rollout agent and trainer (PEFT).

Every published version is an adapter folder, never a full model, and the agent's engine hot-loads each one.
No reward assertion: adapters on the projections only (vLLM serves no lm_head / embed_tokens adapter) learn
this random model's copy task too slowly to test reliably in minutes. Measured 2026-11-24, 150 steps at
learningRate 3e-3, mean reward over steps 1-30 -> 121-150: 0.0037 -> 0.0110, 0.0049 -> 0.0085 and
0.0042 -> 0.0057 in three runs (~3 min each); at learningRate 1e-12: 0.0023 -> 0.0023. The rise is real
but too small and variable for a bar (issue 14 item 3: a learning test on a task LoRA learns fast remains).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS = 30


def read_metrics(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("lora-run")
    doc = yaml.safe_load((ROOT / "examples" / "lora-cpu.yaml").read_text())
    doc["metadata"]["name"] = "lora-run"
    doc["spec"]["training"]["totalSteps"] = STEPS
    manifest = tmp / "lora.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    workdir = tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    return proc, workdir


def test_the_lora_run_finishes_every_step(lora_run):
    proc, workdir = lora_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(workdir)
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["policy_version"] >= STEPS and rows[-1]["failed_groups"] == 0


def test_every_published_version_is_an_adapter_and_the_engine_served_it(lora_run):
    proc, workdir = lora_run
    versions = sorted((workdir / "weights").glob("v*"), key=lambda p: int(p.name[1:]))
    assert versions, "no weights published"
    for v in versions:
        assert {p.name for p in v.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}, v
    config = json.loads((versions[-1] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32)
    served = re.findall(r"vLLM serves adapter kuberl-v(\d+)", (workdir / "logs" / "rollout-0.log").read_text())
    assert {int(v) for v in served} >= set(range(1, STEPS + 1)), "the engine did not hot-load every version"
