"""Qwen3-MoE <-> megatron-core conversion (convert.py + convert_moe.py): pure tensor tests, no process group.

The MoE layers' router and experts, cut over expert-parallel ranks (and pipeline stages), gathered back to
the exact HF checkpoint tensors; the routing configuration that reproduces HF's; what is refused, by name.
test_megatron_moe.py checks the same layouts numerically against real megatron-core models.
"""

from __future__ import annotations

import pytest
import torch
from megatron_models import TINY_MOE, hf_state, tiny_config, tiny_model

from kuberl.runtime.trainer.megatron import convert, convert_moe

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in TINY_MOE}


def all_ranks(hf, shape, pp, ep):
    """shards[pp][tp=0] with the EP ranks merged (what megatron_to_hf takes)."""
    return [[convert_moe.merge_ep([convert.hf_to_megatron(hf, shape, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep) for e in range(ep)],
                                  shape.moe)] for p in range(pp)]


@pytest.mark.parametrize(("pp", "ep"), [(1, 1), (1, 2), (1, 4), (2, 2)], ids=["pp1-ep1", "pp1-ep2", "pp1-ep4", "pp2-ep2"])
@pytest.mark.parametrize("name", list(TINY_MOE))
def test_moe_split_over_expert_ranks_and_gather_back_is_exact(models, name, pp, ep):
    hf = hf_state(models[name])
    shape = convert.model_shape(models[name].config)
    back = convert.megatron_to_hf(all_ranks(hf, shape, pp, ep), shape)
    assert sorted(back) == sorted(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_each_expert_rank_holds_its_experts_numbered_from_zero(models):
    hf = hf_state(models["qwen3-moe"])
    s = convert.model_shape(models["qwen3-moe"].config)
    r1 = convert.hf_to_megatron(hf, s, ep_rank=1, ep_size=2)
    L = "decoder.layers.1.mlp."
    assert sorted(k for k in r1 if k.startswith(L)) == [L + f"experts.local_experts.{j}.linear_fc{i}.weight" for j in (0, 1) for i in (1, 2)] + \
        [L + "router.weight"]
    # local expert 1 of EP rank 1 is global expert 3: fc1 = [gate; up], fc2 = down
    x = "model.layers.1.mlp.experts.3."
    assert torch.equal(r1[L + "experts.local_experts.1.linear_fc1.weight"], torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]]))
    assert torch.equal(r1[L + "experts.local_experts.1.linear_fc2.weight"], hf[x + "down_proj.weight"])
    assert torch.equal(r1[L + "router.weight"], hf["model.layers.1.mlp.gate.weight"])  # the router on every rank
    assert convert.tp_kind(L + "router.weight") == "replicated"


def test_fused_transformers_experts_and_checkpoint_names_round_trip(models):
    m = models["qwen3-moe-mixed"]
    fused = {k: v.detach() for k, v in m.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.gate_proj.weight" in fused  # layer 0 dense
    ck = convert_moe.checkpoint_names(fused)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in ck and not any(k.endswith("gate_up_proj") for k in ck)
    back = convert_moe.fused_names(ck)
    assert sorted(back) == sorted(fused) and all(torch.equal(back[k], v) for k, v in fused.items())
    # hf_to_full takes either
    s = convert.model_shape(m.config)
    a, b = convert.hf_to_full(fused, s), convert.hf_to_full(ck, s)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_config_routes_as_hf():
    tc, gpt, spec = convert.megatron_config(tiny_config("qwen3-moe"), ep_size=2)
    assert (tc["num_moe_experts"], tc["moe_router_topk"], tc["moe_ffn_hidden_size"], tc["ffn_hidden_size"]) == (4, 2, 32, 96)
    assert tc["moe_router_score_function"] == "softmax" and tc["moe_router_pre_softmax"] is False  # top-k of logits, softmax over k
    assert (tc["moe_router_load_balancing_type"], tc["moe_aux_loss_coeff"], tc["moe_expert_capacity_factor"]) == ("none", 0.0, None)
    assert (tc["moe_token_dispatcher_type"], tc["moe_grouped_gemm"], tc["expert_model_parallel_size"]) == ("allgather", False, 2)
    assert tc["moe_layer_freq"] == [1, 1] and tc["qk_layernorm"]
    tc = convert.megatron_config(tiny_config("qwen3-moe-mixed"))[0]
    assert tc["moe_router_pre_softmax"] is True and tc["moe_layer_freq"] == [0, 1]  # mlp_only_layers [0]
    cfg = tiny_config("qwen3-moe").to_dict() | {"decoder_sparse_step": 2, "num_hidden_layers": 4}
    assert convert.model_shape(cfg).moe.layers == (False, True, False, True)


def test_transformer_engine_names_keep_a_moe_layers_pre_mlp_norm(models):
    m = models["qwen3-moe-mixed"]
    r = convert.hf_to_megatron(hf_state(m), convert.model_shape(m.config))
    te = convert.megatron_names(r, te=True)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te  # dense layer: fused into fc1
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te  # MoE layer: its own norm module
    assert convert.megatron_names(te, te=False).keys() == r.keys()


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 1, "norm_topk_prob": True}, "num_experts_per_tok 1 with norm_topk_prob"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and num_experts 4"),
    ({"mlp_only_layers": [0, 1]}, "leave no MoE layer"),
    ({"mlp_only_layers": [7]}, r"mlp_only_layers \[7\]"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_moe_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        convert.model_shape(tiny_config("qwen3-moe").to_dict() | change)


def test_parallel_sizes_a_moe_model_cannot_take_are_refused():
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by expert parallel size 3"):
        convert.megatron_config(tiny_config("qwen3-moe"), ep_size=3)
    with pytest.raises(ValueError, match="tensor parallel size 2 with a mixture-of-experts model needs sequence parallelism"):
        convert.megatron_config(tiny_config("qwen3-moe"), tp_size=2)
    with pytest.raises(ValueError, match="expert parallel size 2 needs a mixture-of-experts model"):
        convert.megatron_config(tiny_config("qwen3"), ep_size=2)
