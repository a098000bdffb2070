"""trainer.parallelism.context (Ulysses context parallel, trainer.backend fsdp) end to end: `kuberl trainer` on 2 torchrun
CPU ranks (gloo) against a real nats-server, each rank feeding half of every packed row.

test_megatron_run.py's scripted agent answers the tickets, so the run at context 2 and the FSDP reference on one rank
train on the same batches with plain SGD: the published weights/v1..v3 and every step's loss, gradient norm, entropy and
token count must match (a statistic counted on both CP ranks, a wrong loss scale or a gradient missing a rank's tokens
shows), at 2 and 4 processes (dp2 x cp2). The model is the tiny Qwen2 with 2 kv heads for 4 (GQA: each CP rank gets 2
query heads and 1 kv head). A trainer killed after its checkpoint resumes and ends on the reference's weights; LoRA
adapters trained at context 2 equal one rank's. `kuberl run` of the quickstart at context 2 (real launcher, vLLM CPU
engine) is in test_kuberl_run_backends.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import test_megatron_run as mg
import yaml
from test_megatron_run import STEPS, ScriptedAgent, assert_same_training, reference, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory) -> Path:
    """The builtin tiny Qwen2 with 2 kv heads for its 4 attention heads, built locally."""
    from kuberl.runtime.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-gqa", num_key_value_heads=2)


@pytest.fixture
def context_manifests(monkeypatch):
    """test_megatron_run's manifests (what its train() writes), plus trainer.parallelism.context and other trainer fields."""
    write = mg.write_manifest

    def write_with_context(path: Path, name: str, model: Path, *, context: int = 1, trainer: dict | None = None, algorithm: dict | None = None,
                           **kw) -> Path:
        write(path, name, model, **kw)
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["trainer"].update(trainer or {}, **({"parallelism": {"context": context}} if context > 1 else {}))
        doc["spec"]["algorithm"].update(algorithm or {})
        path.write_text(yaml.safe_dump(doc))
        return path

    monkeypatch.setattr(mg, "write_manifest", write_with_context)


LAYOUTS = {  # name -> (processes, ppoMinibatches, klCoef, extra trainer fields); context 2, data parallel over the rest
    "cp2": (2, 1, 0.0, {}),  # pi_prox from the update's own forward
    "cp2-kl-recompute": (2, 2, 0.05, {"gradientCheckpointing": True}),  # pi_prox and pi_ref forwards, two optimizer steps, recomputation
    "dp2-cp2": (4, 2, 0.0, {}),  # 2 data-parallel replicas of 2 CP ranks: rows dealt per replica, FSDP over all 4
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_context_parallel_trains_the_same_weights_as_one_rank(tmp_path, tmp_path_factory, nats_server, gqa_model_dir, layout,
                                                                    context_manifests):
    world, minibatches, kl, extra = LAYOUTS[layout]
    agent = ScriptedAgent(gqa_model_dir)
    ref = await reference(tmp_path_factory, nats_server.url, gqa_model_dir, agent, minibatches, kl)
    t0 = time.monotonic()
    got = await train(tmp_path, f"cp-{layout}", nats_server.url, gqa_model_dir, agent, backend="fsdp", world=world, context=2,
                      minibatches=minibatches, kl=kl, trainer=extra)
    print(f"context parallel {layout}: {time.monotonic() - t0:.1f}s")
    trainer = yaml.safe_load((tmp_path / f"cp-{layout}.yaml").read_text())["spec"]["trainer"]
    assert trainer["parallelism"] == {"context": 2} and all(trainer[k] == v for k, v in extra.items()), trainer
    assert_same_training(got, ref, gqa_model_dir)
    log = (tmp_path / f"cp-{layout}.log").read_text()
    assert "context parallel 2" in log, log[-3000:]  # the trainer said it runs the layout (not plain data parallel)
    # what vLLM loads: the model's own config, not the trainer's attention function
    assert "kuberl_ulysses" not in (got / "weights" / f"v{STEPS}" / "config.json").read_text()


async def test_a_killed_context_parallel_trainer_resumes_and_ends_on_the_reference_weights(tmp_path, tmp_path_factory, nats_server,
                                                                                          gqa_model_dir, context_manifests):
    """context 2, checkpoints every 2 steps (FSDP's DCP shards, no megatron-*.pt files): killed after step 2's checkpoint,
    restarted, it resumes at step 2, trains step 3 and publishes the 1-rank reference's v3."""
    agent = ScriptedAgent(gqa_model_dir)
    ref = await reference(tmp_path_factory, nats_server.url, gqa_model_dir, agent, 1, 0.0)
    path = mg.write_manifest(tmp_path / "exp.yaml", "cp-resume", gqa_model_dir, backend="fsdp", world=2, context=2, every=2)
    await mg.kill_after_checkpoint_and_resume(path, nats_server.url, tmp_path / "work", agent, ref, [])
    assert (tmp_path / "work" / "checkpoints" / "step-00000002" / ".metadata").is_file()  # DCP's index: the sharded state


async def test_lora_adapters_trained_at_context_2_equal_one_ranks(tmp_path_factory, nats_server, gqa_model_dir, context_manifests):
    """algorithm.lora with context 2: the PEFT-wrapped model's attention is the Ulysses one too; the published adapters
    v1..v3 equal those of one rank on the same batches."""
    from safetensors.torch import load_file

    agent = ScriptedAgent(gqa_model_dir)
    lora = {"lora": {"rank": 4, "alpha": 8, "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
    got = {}
    for world in (1, 2):
        got[world] = await train(tmp_path_factory.mktemp(f"lora-w{world}"), f"lora-w{world}", nats_server.url, gqa_model_dir, agent,
                                 backend="fsdp", world=world, context=world, algorithm=lora)
    for v in range(1, STEPS + 1):
        one, two = (load_file(str(got[w] / "weights" / f"v{v}" / "adapter_model.safetensors")) for w in (1, 2))
        assert sorted(one) == sorted(two) and one
        moved = max(t.abs().max().item() for k, t in one.items() if "lora_B" in k)  # B starts at 0
        d = max((one[k] - two[k]).abs().max().item() for k in one)
        print(f"lora v{v}: max |context 2 - 1 rank| {d:.2e}, lora_B moved to {moved:.2e}")
        assert moved > 1e-3 and d < 1e-5, (v, d, moved)
