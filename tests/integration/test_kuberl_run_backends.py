"""`kuberl run` of the quickstart with the other trainer layouts: Megatron at tensor 2, Megatron at expert 2 on a tiny
Qwen3-MoE, FSDP at context 2. Each is the real launcher, nats-server, vLLM CPU engine, rollout agent and a 2-process
trainer; each run must finish every step and publish weights that transformers loads and that moved.

Their numerics against the one-rank FSDP reference are in test_megatron_run.py, test_megatron_moe_run.py and
test_context_parallel_run.py (a scripted agent, no engine). These runs start an engine, so this file is in
tests/conftest.py's ENGINE_FILES: the engine worker runs them one after another with the other engine files.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_megatron_moe_run import build_tiny_moe
from test_megatron_run import max_diff, metrics

from kuberl.runtime.trainer.weights import load_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def kuberl_run_quickstart(tmp_path: Path, name: str, **spec) -> Path:
    """`kuberl run` (the real launcher, nats-server, vLLM CPU engine, rollout agent) of examples/quickstart.yaml with
    batch 4 x 4 samples and `spec` merged over its spec; asserts exit 0 and returns the run's workdir."""
    root = Path(__file__).resolve().parents[2]
    doc = yaml.safe_load((root / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["algorithm"].update(batchSize=4, samplesPerPrompt=4)
    doc["spec"].update(spec)
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)], cwd=root,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("model") / "moe")


@pytest.mark.megatron
def test_kuberl_run_trains_with_the_megatron_backend_on_the_vllm_engine(tmp_path):
    """`kuberl run` of the quickstart with trainer.backend megatron, tensor 2 on 2 CPU processes: the real launcher,
    nats-server, vLLM CPU engine and rollout agent. Every step completes and reports the FSDP path's statistics,
    and the last published version is a transformers model that differs from the initial one."""
    workdir = kuberl_run_quickstart(tmp_path, "mg-run", training={"totalSteps": 4}, checkpoint={"everySteps": 2, "keep": 2},
                                    trainer={"backend": "megatron", "accelerator": {"type": "cpu", "count": 2}, "parallelism": {"tensor": 2}})
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "behavior_weight_mean", "approx_kl", "lr", "tokens", "staleness_max"):
        assert all(key in r for r in rows), key
    # A random tiny model rarely earns a reward in 4 steps (a zero-advantage step has a zero gradient): the numbers
    # of the update are checked against FSDP above; here the run itself, and that the optimizer stepped (AdamW's decay).
    assert all(0 < r["entropy"] < 10 for r in rows)
    from transformers import AutoModelForCausalLM

    last = workdir / "weights" / "v4"
    AutoModelForCausalLM.from_pretrained(last)
    initial = load_weights(workdir / "models" / "tiny-qwen2")
    assert max_diff(load_weights(last), initial) > 0
    assert (workdir / "checkpoints" / "step-00000004" / "megatron-tp1-pp0.pt").is_file()


@pytest.mark.megatron
def test_kuberl_run_trains_a_moe_model_at_expert_2_on_the_vllm_engine(tmp_path, moe_dir):
    """`kuberl run` of the quickstart on the tiny Qwen3-MoE: trainer.backend megatron at expert 2 on 2 CPU processes,
    the real launcher, nats-server, vLLM CPU engine (which serves Qwen3-MoE: its CPU unquantized MoE backend) and
    rollout agent. Every step completes and the engine loads published versions in order (its log says so; a group older
    than maxHeadOffpolicyness 2 is counted in over_stale: later steps' groups come from published weights, not the initial ones)."""
    workdir = kuberl_run_quickstart(tmp_path, "mg-moe-run", model={"path": str(moe_dir), "dtype": "float32"}, training={"totalSteps": 4},
                                    checkpoint={"everySteps": 2, "keep": 2},
                                    trainer={"backend": "megatron", "accelerator": {"type": "cpu", "count": 2}, "parallelism": {"expert": 2}})
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Every group is trained (staleness.dropStaleGroups is off): a straggler that outlives v + 2 is trained and counted in
    # over_stale, in exactly the steps whose staleness_max exceeds 2 (one CI run on a busy VM had such a step).
    over = [r["over_stale"] for r in rows]
    grew = [now > before for before, now in zip([0, *over], over)]
    assert [r["staleness_max"] > 2 for r in rows] == grew, list(zip([r["staleness_max"] for r in rows], over))
    assert rows[-1]["dropped_stale"] == 0
    rollout_log = (workdir / "logs" / "rollout-0.log").read_text()
    # The engine loaded published MoE weights (both EP ranks' experts), in order: an agent that falls behind (in one CI
    # run its weights watch lost its consumer under load) loads the newest version published and skips the older ones,
    # so which versions it loads depends on timing. The admission capacity lets
    # (2 + 1) batches start on v0, so step 4 needs groups issued at v1 or later, whose tickets wait for those weights: one of v1-v3.
    loaded = [int(v) for v in re.findall(r"vLLM loaded weights v(\d+) from", rollout_log)]
    assert loaded and loaded == sorted(set(loaded)) and loaded[0] <= 3, rollout_log[-3000:]
    from transformers import AutoModelForCausalLM

    last = workdir / "weights" / "v4"
    AutoModelForCausalLM.from_pretrained(last)
    assert max_diff(load_weights(last), load_weights(moe_dir)) > 0
    assert (workdir / "checkpoints" / "step-00000004" / "megatron-tp0-pp0-ep1.pt").is_file()


def test_kuberl_run_trains_at_context_2_on_the_vllm_engine(tmp_path):
    """`kuberl run` of the quickstart with the allocation shorthand vllm:d1+fsdp:d1c2 (2 trainer processes, one CP group)."""
    # the engine, its replica count and accelerators, the trainer's backend, process count and layout: all from the shorthand
    workdir = kuberl_run_quickstart(tmp_path, "cp-run", allocation="vllm:d1+fsdp:d1c2", rollout={"accelerator": {"type": "cpu"}, "concurrency": 16},
                                    trainer={"accelerator": {"type": "cpu"}}, training={"totalSteps": 3}, checkpoint={"everySteps": 2, "keep": 2})
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["entropy"] < 10 and r["tokens"] > 0 for r in rows), rows
    trainer_log = "\n".join(p.read_text(errors="replace") for p in (workdir / "logs").glob("trainer*"))
    assert "context parallel 2" in trainer_log, trainer_log[-3000:]
    last = workdir / "weights" / "v3"
    assert max_diff(load_weights(last), load_weights(workdir / "models" / "tiny-qwen2")) > 0
    assert json.loads((last / "config.json").read_text())["num_attention_heads"] == 4
