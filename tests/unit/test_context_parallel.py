"""Context (sequence) parallel, Ulysses style (runtime/kuberl/runtime/trainer/context_parallel.py), on two gloo ranks.

Each rank feeds half of every packed row; the all-to-alls cut the heads instead for the attention. The log-probs and
entropies every rank gets, and the gradients summed over the two ranks, must equal one process's over the whole rows:
packed rows of unequal sequences, a GQA model (2 kv heads for 4) and a multi-head one, a micro-batch where one rank's
slice scores no token, gradient checkpointing, LoRA adapters."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kuberl.runtime.errors import ConfigError
from kuberl.runtime.trainer.context_parallel import check_model
from tests.unit.torchrun import torchrun

WORKER = '''
import copy, os, sys
import torch, torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM
from kuberl.runtime.trainer import context_parallel as C
from kuberl.runtime.trainer.batch import response_logprobs

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cp = C.setup_context_parallel(rank, world, world)
assert (cp.size, cp.rank, cp.dp_rank, cp.dp_size) == (2, rank, 0, 1)

def rows(seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(7)]
    outputs = [torch.randint(3, 60, (int(torch.randint(0, 15, (1,), generator=g)),), generator=g).tolist() for _ in range(7)]
    return prompts, outputs

CASES = [("ragged", rows(3)), ("more", rows(5)),
         ("slice-without-scores", ([list(range(3, 23)), [5, 6, 7]], [[8, 9], [10, 11, 12]]))]

def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

def run(model, prompts, outputs, cp):
    width = max(len(o) for o in outputs)
    weights = torch.randn(len(prompts), width, generator=torch.Generator().manual_seed(4))
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, prompts, outputs, width, temperature=0.7, entropy=True, packed=True, cp=cp)
    (lp * weights).sum().backward()
    return lp.detach(), ent, grads(model)

for kv in (2, 4):
    for variant in ("plain", "checkpointing", "lora"):
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=kv, tie_word_embeddings=False, attn_implementation="sdpa")
        ref = Qwen2ForCausalLM(cfg).float().train()
        if variant == "lora":
            from peft import LoraConfig, get_peft_model
            ref = get_peft_model(ref, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
            for n, p in ref.named_parameters():  # adapters away from the identity (B = 0), so every one gets a gradient
                if "lora_B" in n:
                    p.data.normal_(0, 0.1)
        par = copy.deepcopy(ref)
        C.enable(par.get_base_model() if variant == "lora" else par, cp)
        if variant == "checkpointing":
            for m in (ref, par):
                m.gradient_checkpointing_enable()
        for name, (prompts, outputs) in CASES:
            lp0, ent0, g0 = run(ref, prompts, outputs, None)
            lp1, ent1, g1 = run(par, prompts, outputs, cp)
            for t in g1.values():
                dist.all_reduce(t)  # what FSDP does: the CP ranks' gradients together are the replica's
            assert sorted(g0) == sorted(g1) and g0, (sorted(g0), sorted(g1))
            dl = max((lp0 - lp1).abs().max().item(), (ent0 - ent1).abs().max().item())
            dg = max((g0[k] - g1[k]).abs().max().item() for k in g0)
            scale = max(g0[k].abs().max().item() for k in g0)
            print(f"RESULT rank {rank} kv {kv} {variant} {name} logp {dl:.3e} grad {dg:.3e} gmax {scale:.3e}", flush=True)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # torch 2.13's CPU teardown at interpreter exit can abort after the results are printed (trainer.main)
'''


def test_ulysses_equals_one_process_on_two_gloo_ranks(tmp_path):
    script = tmp_path / "cp_worker.py"
    script.write_text(WORKER)
    proc = torchrun(str(script), timeout=300, cwd=tmp_path)
    num = r"([0-9.]+e[+-]\d+)"
    found = re.findall(rf"RESULT rank (\d) kv (\d) (\w+) ([\w-]+) logp {num} grad {num} gmax {num}", proc.stdout)
    assert len(found) == 2 * 2 * 3 * 3, proc.stdout
    for rank, kv, variant, case, dl, dg, gmax in found:
        # log-probs to 1e-5, gradients to 1e-6 of the largest gradient entry (float32 summation order; 1.4e-7 seen)
        assert float(dl) <= 1e-5 and float(dg) <= 1e-6 * float(gmax) and float(gmax) > 1e-3, (rank, kv, variant, case, dl, dg, gmax)


@pytest.mark.parametrize("heads, kv, ok", [(4, 2, True), (4, 4, True), (4, 1, False), (6, 6, False)])
def test_head_counts_that_do_not_divide_are_refused_naming_the_field(heads, kv, ok):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    if ok:
        check_model(config, 4 if heads == 4 and kv == 4 else 2)
        return
    with pytest.raises(ConfigError, match=rf"trainer.parallelism.context \d must divide .*num_attention_heads {heads}, num_key_value_heads {kv}"):
        check_model(config, 4)


def test_sliding_window_models_are_refused():
    with pytest.raises(ConfigError, match="sliding-window"):
        check_model(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8), 2)
