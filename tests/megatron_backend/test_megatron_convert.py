"""HF <-> megatron-core weight and config conversion (kuberl.runtime.trainer.megatron.convert): pure tensor tests.

No process group and no megatron-core import: the layouts are checked against their definitions
(megatron's grouped QKV, gated fc1 = [gate; up] per TP shard, column/row splits, stage layer numbering)
and every split is gathered back to the exact HF tensors. tests/megatron_backend/test_megatron_tp.py checks the
same layouts numerically against real megatron-core models.
"""

from __future__ import annotations

import pytest
import torch
from megatron_models import TINY, hf_state, tiny_config, tiny_model

from kuberl.runtime.trainer.megatron import convert

pytestmark = pytest.mark.megatron

SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in TINY}


def all_ranks(hf, shape, tp, pp):
    return [[convert.hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp) for t in range(tp)] for p in range(pp)]


@pytest.mark.parametrize(("tp", "pp"), SPLITS, ids=[f"tp{t}-pp{p}" for t, p in SPLITS])
@pytest.mark.parametrize("name", list(TINY))
def test_split_and_gather_back_is_exact(models, name, tp, pp):
    hf = hf_state(models[name])
    shape = convert.model_shape(models[name].config)
    back = convert.megatron_to_hf(all_ranks(hf, shape, tp, pp), shape)
    assert sorted(back) == sorted(hf)
    for k, v in hf.items():
        assert back[k].shape == v.shape and torch.equal(back[k], v), k


@pytest.mark.parametrize("name", list(TINY))
def test_rank_shapes_and_placement(models, name):
    """Each rank holds its stage's layers (renumbered from 0), the embedding on the first stage, norm and output on
    the last (a tied model's last stage keeps a copy of the embedding), TP shards of the right size."""
    hf, cfg = hf_state(models[name]), models[name].config
    s = convert.model_shape(cfg)
    tp, pp = 2, 2
    ranks = all_ranks(hf, s, tp, pp)
    V = convert.padded_vocab_size(s.vocab, tp)
    for p in range(pp):
        for t in range(tp):
            r = ranks[p][t]
            assert {int(k.split(".")[2]) for k in r if k.startswith("decoder.layers.")} == {0}  # 2 layers / 2 stages
            assert ("embedding.word_embeddings.weight" in r) == (p == 0)
            assert ("decoder.final_layernorm.weight" in r) == (p == pp - 1)
            assert ("output_layer.weight" in r) == (p == pp - 1)
            if "output_layer.weight" in r:
                assert r["output_layer.weight"].shape == (V // tp, s.hidden)
            if s.tied and p == pp - 1:  # the copy of the embedding shard, vocab padding included
                assert torch.equal(r["output_layer.weight"], ranks[0][t]["embedding.word_embeddings.weight"])
            L = "decoder.layers.0."
            assert r[L + "self_attention.linear_qkv.weight"].shape == ((s.heads + 2 * s.kv_heads) * s.head_dim // tp, s.hidden)
            assert r[L + "self_attention.linear_proj.weight"].shape == (s.hidden, s.heads * s.head_dim // tp)
            assert r[L + "mlp.linear_fc1.weight"].shape == (2 * s.ffn // tp, s.hidden)
            assert r[L + "mlp.linear_fc2.weight"].shape == (s.hidden, s.ffn // tp)
            assert (L + "self_attention.linear_qkv.bias" in r) == (s.model_type == "qwen2")
            assert (L + "self_attention.q_layernorm.weight" in r) == (s.model_type == "qwen3")
    # stage 1's local layer 0 is global layer 1
    assert torch.equal(ranks[1][0]["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])


def test_qkv_is_grouped_by_query_group(models):
    """linear_qkv rows: for each kv group g, its query heads, then k_g, then v_g (megatron's layout); TP rank r
    holds whole groups, r * groups/tp onwards."""
    hf = hf_state(models["qwen2"])
    s = convert.model_shape(models["qwen2"].config)
    d, per = s.head_dim, s.heads // s.kv_heads
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    qb = hf["model.layers.0.self_attn.q_proj.bias"]
    expected = []
    for g in range(s.kv_heads):
        expected += [q[(g * per + h) * d:(g * per + h + 1) * d] for h in range(per)] + [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    full = convert.hf_to_full(hf, s)
    assert torch.equal(full["decoder.layers.0.self_attention.linear_qkv.weight"], torch.cat(expected))
    assert torch.equal(full["decoder.layers.0.self_attention.linear_qkv.bias"][: per * d], qb[: per * d])
    r1 = convert.hf_to_megatron(hf, s, tp_rank=1, tp_size=2)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(r1, torch.cat(expected[len(expected) // 2:]))  # group 1: q heads 2, 3, k1, v1


def test_gated_fc1_shard_is_gate_then_up_of_that_rank(models):
    hf = hf_state(models["qwen3"])
    s = convert.model_shape(models["qwen3"].config)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    h = s.ffn // 2
    for r in range(2):
        shard = convert.hf_to_megatron(hf, s, tp_rank=r, tp_size=2)["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(shard, torch.cat([gate[r * h:(r + 1) * h], up[r * h:(r + 1) * h]]))


def test_row_parallel_splits_the_input_dim_and_the_vocab_is_padded_with_zeros(models):
    hf = hf_state(models["llama"])
    s = convert.model_shape(models["llama"].config)
    assert s.vocab == 127 and convert.padded_vocab_size(127, 2) == 128
    r1 = convert.hf_to_megatron(hf, s, tp_rank=1, tp_size=2)
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2:])
    emb = r1["embedding.word_embeddings.weight"]
    assert emb.shape == (64, s.hidden) and torch.equal(emb[:63], hf["model.embed_tokens.weight"][64:]) and not emb[63].any()
    assert torch.equal(r1["output_layer.weight"][:63], hf["lm_head.weight"][64:])


def test_megatron_config_of_each_family():
    tc, gpt, spec = convert.megatron_config(tiny_config("qwen3"), tp_size=2, pp_size=2)
    assert (tc["num_query_groups"], tc["kv_channels"], tc["ffn_hidden_size"], tc["qk_layernorm"], tc["add_qkv_bias"]) == (2, 32, 96, True, False)
    assert (tc["normalization"], tc["gated_linear_unit"], tc["add_bias_linear"], tc["layernorm_epsilon"]) == ("RMSNorm", True, False, 1e-6)
    assert (tc["tensor_model_parallel_size"], tc["pipeline_model_parallel_size"]) == (2, 2)
    assert gpt == dict(vocab_size=128, max_sequence_length=64, position_embedding_type="rope", rotary_base=1e6,
                       share_embeddings_and_output_weights=False, parallel_output=True)
    assert spec == dict(qk_layernorm=True, normalization="RMSNorm")
    tc, gpt, _ = convert.megatron_config(tiny_config("qwen2-tied"))
    assert tc["add_qkv_bias"] and not tc["qk_layernorm"] and tc["kv_channels"] == 16 and gpt["share_embeddings_and_output_weights"]
    assert convert.megatron_config(tiny_config("llama"), tp_size=2)[1]["vocab_size"] == 128
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
    gpt = convert.megatron_config(cfg)[1]
    assert (gpt["rotary_base"], gpt["rope_scaling"], gpt["rope_scaling_factor"]) == (500000.0, True, 8.0)


@pytest.mark.parametrize(("name", "change", "message"), [
    ("qwen2", {"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq_factor"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_unsupported_models_are_refused_by_name(name, change, message):
    cfg = tiny_config(name).to_dict() | change
    with pytest.raises(ValueError, match=message):
        convert.model_shape(cfg)


def test_parallel_sizes_that_do_not_divide_the_model_are_refused():
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible by tensor parallel size 4"):
        convert.megatron_config(tiny_config("qwen2"), tp_size=4)
    with pytest.raises(ValueError, match="num_hidden_layers 2 is not divisible by pipeline parallel size 4"):
        convert.megatron_config(tiny_config("qwen2"), pp_size=4)


def test_transformer_engine_names_round_trip(models):
    r = convert.hf_to_megatron(hf_state(models["qwen3"]), convert.model_shape(models["qwen3"].config))
    te = convert.megatron_names(r, te=True)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te and "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert not any(k.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for k in te)
    assert convert.megatron_names(te, te=False).keys() == r.keys()
