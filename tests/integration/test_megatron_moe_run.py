"""trainer.backend megatron with expert parallelism end to end: `kuberl trainer` on a tiny Qwen3-MoE, 2 CPU ranks over gloo.

The harness of test_megatron_run.py (a real nats-server, a scripted agent answering every ticket with a group that
depends only on its data set item): the same 3 steps run with the FSDP trainer on one rank (the reference) and with
megatron at expert 2 (data parallel 2, each rank 2 of the 4 experts; two PPO minibatches of 3 rows, so the ranks
train different row counts and one pads with filler micro-batches). Every step's loss, grad norm and statistics,
and every published weights/v{N}, must match the reference's. The published folder is what vLLM and transformers
load (per-expert checkpoint names, gathered from both EP ranks); the checkpoint's per-(tp, pp, ep) files read back
with checkpoint.read_model_state give the same weights; a run killed after its step-2 checkpoint resumes from its
EP shards and ends on the reference's weights. `kuberl run` at expert 2 (vLLM CPU engine) is in
test_kuberl_run_backends.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from test_megatron_run import (
    STEPS,
    ScriptedAgent,
    assert_same_training,
    finish,
    kill_after_checkpoint_and_resume,
    max_diff,
    reference,
    start_trainer,
    train,
    write_manifest,
)

from kuberl.runtime.trainer import checkpoint as ck
from kuberl.runtime.trainer.weights import load_weights

pytestmark = [pytest.mark.integration, pytest.mark.megatron, pytest.mark.timeout(300)]


def build_tiny_moe(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE (4 experts of hidden 32, top-2 with normalised weights, 2 MoE layers) with the builtin
    tokenizer, in float32, saved as transformers writes it (per-expert tensors)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from kuberl.runtime.models import IM_END, PAD, build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
                         eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.convert_tokens_to_ids(PAD), bos_token_id=None)
    cfg.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
        with torch.no_grad():  # a router far from uniform: the experts' choice matters to every token
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("model") / "moe")


async def test_megatron_expert_parallel_trains_the_same_weights_as_fsdp(tmp_path, tmp_path_factory, nats_server, moe_dir):
    agent = ScriptedAgent(moe_dir)
    ref = await reference(tmp_path_factory, nats_server.url, moe_dir, agent, 2, 0.0)
    t0 = time.monotonic()
    got = await train(tmp_path, "mg-ep2", nats_server.url, moe_dir, agent, backend="megatron", world=2, expert=2, minibatches=2)
    print(f"megatron expert 2: {time.monotonic() - t0:.1f}s")
    assert_same_training(got, ref, moe_dir)
    last = got / "weights" / f"v{STEPS}"
    published = load_weights(last)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in published and "model.layers.0.mlp.gate.weight" in published
    from transformers import AutoModelForCausalLM

    from kuberl.runtime.trainer.megatron.convert_moe import fused_names

    model = AutoModelForCausalLM.from_pretrained(last, dtype=torch.float32)  # what an engine loads: every expert, both EP ranks'
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in fused_names(published).items())
    latest = ck.latest_checkpoint(got / "checkpoints")
    files = sorted(x.name for x in latest.path.glob("megatron-*.pt"))
    assert files == ["megatron-tp0-pp0-ep0.pt", "megatron-tp0-pp0-ep1.pt"], files
    assert latest.step == STEPS and max_diff(ck.read_model_state(latest.path), published) == 0


async def test_a_killed_expert_parallel_trainer_resumes_from_its_shards(tmp_path, tmp_path_factory, nats_server, moe_dir):
    """expert 2, checkpoints every 2 steps: killed while waiting for step 3's groups, it resumes at step 2 from its
    per-EP-rank model and optimizer shards, trains step 3 and publishes the reference's v3."""
    agent = ScriptedAgent(moe_dir)
    ref = await reference(tmp_path_factory, nats_server.url, moe_dir, agent, 2, 0.0)
    path = write_manifest(tmp_path / "exp.yaml", "mg-ep2-resume", moe_dir, backend="megatron", world=2, expert=2, minibatches=2, every=2)
    await kill_after_checkpoint_and_resume(path, nats_server.url, tmp_path / "work", agent, ref, ["megatron-tp0-pp0-ep0.pt", "megatron-tp0-pp0-ep1.pt"])


def test_expert_parallel_on_a_dense_model_is_refused_naming_the_field(tmp_path):
    """Admission cannot tell a dense model from a MoE one; the trainer can: exit 2, the field named."""
    from kuberl.runtime.models import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    path = write_manifest(tmp_path / "exp.yaml", "mg-dense-ep", model, backend="megatron", world=2, expert=2)
    log = tmp_path / "trainer.log"
    proc = start_trainer(path, "nats://127.0.0.1:1", tmp_path / "work", log, 2)
    code = finish(proc, log, timeout=120)
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "trainer.parallelism.expert 2 needs a mixture-of-experts model; qwen2" in text
