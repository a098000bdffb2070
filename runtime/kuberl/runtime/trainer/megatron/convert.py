"""Hugging Face <-> megatron-core weights and configs for Qwen2, Qwen3, Llama and Qwen3-MoE: pure functions, no process group.

Three layouts of the same weights:

* **HF**: transformers names (`model.layers.3.self_attn.q_proj.weight`, ...), one tensor per name.
* **megatron full**: megatron-core `GPTModel` names (local layer spec, see `megatron_names` for the
  Transformer Engine spelling) with *global* layer numbers and tensor-parallel size 1. This is where the
  layout changes happen: q/k/v merge into one `linear_qkv` grouped by query group
  (`[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]`, megatron's
  `Attention.get_query_key_value_tensors`), gate/up merge into `linear_fc1` = `[gate; up]` (megatron's gated
  MLP chunks fc1's output in two, `silu(first) * second`).
* **megatron rank**: what one (tp_rank, pp_rank) holds: the pipeline stage's layers renumbered from 0, the
  embedding on the first stage, the final norm and output layer on the last, every tensor-parallel weight cut
  to its shard. Column-parallel weights (qkv, the vocabulary of embedding/output) split along dim 0,
  row-parallel ones (attention `linear_proj`, `linear_fc2`) along dim 1; the gated fc1 splits gate and up
  separately and each shard is `[gate_r; up_r]`; norms are replicated. The vocabulary is padded with zero
  rows up to a multiple of tp_size (x `vocab_multiple`) because megatron's vocab-parallel layers need equal
  shards; the padded logits must be masked (model.py does) and the padding is cut off on the way back.

Going HF -> rank: `hf_to_megatron(hf, shape, tp_rank=, tp_size=, pp_rank=, pp_size=, ep_rank=, ep_size=)`.
Going back: `megatron_to_hf(shards, shape)` with `shards[pp_rank][tp_rank]` = each rank's dict (for expert
parallelism, first `convert_moe.merge_ep` of the EP ranks' dicts); or, one parameter at a time (what a
streaming weight publisher does after an all-gather over the TP group), `merge_tp(name, parts, shape)` then
`full_to_hf({global_name: tensor}, shape)`. The round trip is exact. The MoE layers' router and experts
(and expert parallelism) are convert_moe.py's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kuberl.runtime.trainer.megatron import convert_moe
from kuberl.runtime.trainer.megatron.convert_moe import MoEShape

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", *convert_moe.MOE_MODEL_TYPES)
_LAYER = re.compile(r"^(decoder\.layers\.|model\.layers\.)(\d+)\.(.*)$")


@dataclass(frozen=True)
class ModelShape:
    """What conversion needs to know about a model (from `model_shape(hf_config)`)."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rms_eps: float
    rope_theta: float
    max_positions: int
    rope_kwargs: dict[str, Any] = field(default_factory=dict)  # GPTModel rope-scaling arguments
    moe: MoEShape | None = None  # the experts of a mixture-of-experts model (convert_moe); None when dense


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def _rope(cfg: Any, model_type: str) -> tuple[float, dict[str, Any]]:
    """(rope theta, GPTModel rope-scaling kwargs); transformers 5 `rope_parameters` or the older rope_theta/rope_scaling."""
    params = dict(_get(cfg, "rope_parameters") or {})
    scaling = dict(_get(cfg, "rope_scaling") or {})
    theta = params.get("rope_theta", _get(cfg, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    if kind == "default":
        return float(theta), {}
    if kind == "linear":
        return float(theta), {"seq_len_interpolation_factor": float(merged["factor"])}
    if kind == "llama3":
        # megatron's RotaryEmbedding._apply_scaling takes only the factor; the rest are its fixed defaults.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        bad = {k: merged.get(k) for k, v in fixed.items() if float(merged.get(k, v)) != v}
        if bad:
            raise ValueError(f"{model_type}: rope_scaling llama3 with {bad} is not supported (megatron-core fixes {fixed})")
        return float(theta), {"rope_scaling": True, "rope_scaling_factor": float(merged["factor"])}
    raise ValueError(f"{model_type}: rope_scaling type {kind!r} is not supported (only default, linear, llama3)")


def model_shape(hf_config: Any) -> ModelShape:
    """Read a transformers config (object or config.json dict); ValueError names what is not supported."""
    mt = _get(hf_config, "model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported by the Megatron backend (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{mt}: hidden_act {act!r} is not supported (only silu, the SwiGLU MLP)")
    if _get(hf_config, "use_sliding_window", False):
        raise ValueError(f"{mt}: use_sliding_window is enabled; sliding-window attention is not supported")
    kinds = set(_get(hf_config, "layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{mt}: layer_types {sorted(kinds)} is not supported (only full_attention)")
    if mt in ("llama", "qwen3", "qwen3_moe") and _get(hf_config, "attention_bias", False):
        raise ValueError(f"{mt}: attention_bias is not supported (megatron adds no o_proj-only bias)")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError(f"{mt}: mlp_bias is not supported")
    heads = int(_get(hf_config, "num_attention_heads"))
    hidden = int(_get(hf_config, "hidden_size"))
    kv = int(_get(hf_config, "num_key_value_heads") or heads)
    if heads % kv:
        raise ValueError(f"{mt}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    theta, rope_kwargs = _rope(hf_config, mt)
    layers = int(_get(hf_config, "num_hidden_layers"))
    moe = convert_moe.moe_shape(hf_config, mt, layers) if mt in convert_moe.MOE_MODEL_TYPES else None
    return ModelShape(
        model_type=mt, num_layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
        head_dim=int(_get(hf_config, "head_dim") or hidden // heads), ffn=int(_get(hf_config, "intermediate_size")),
        vocab=int(_get(hf_config, "vocab_size")), tied=bool(_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2", qk_norm=mt in ("qwen3", "qwen3_moe"), rms_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        rope_theta=theta, max_positions=int(_get(hf_config, "max_position_embeddings")), rope_kwargs=rope_kwargs, moe=moe,
    )


def padded_vocab_size(vocab: int, tp_size: int, vocab_multiple: int = 1) -> int:
    """The vocabulary rounded up to a multiple of tp_size * vocab_multiple (megatron's vocab-parallel layers need equal shards)."""
    step = tp_size * vocab_multiple
    return int(math.ceil(vocab / step) * step)


def check_parallel(shape: ModelShape, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """ValueError when the model cannot be cut into tp_size x pp_size (x ep_size experts) (what this converter supports)."""
    if shape.moe is not None:
        convert_moe.check_parallel(shape.model_type, shape.moe, tp_size, ep_size)
    elif ep_size > 1:
        raise ValueError(f"{shape.model_type}: expert parallel size {ep_size} needs a mixture-of-experts model; this one is dense")
    for what, n in (("num_attention_heads", shape.heads), ("num_key_value_heads", shape.kv_heads), ("intermediate_size", shape.ffn)):
        if n % tp_size:
            raise ValueError(f"{shape.model_type}: {what} {n} is not divisible by tensor parallel size {tp_size}")
    if shape.num_layers % pp_size:
        raise ValueError(f"{shape.model_type}: num_hidden_layers {shape.num_layers} is not divisible by pipeline parallel size {pp_size}")


def megatron_config(hf_config: Any, *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, dtype: torch.dtype = torch.float32,
                    vocab_multiple: int = 1, **overrides: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(TransformerConfig kwargs, GPTModel kwargs, get_gpt_layer_*_spec kwargs) of a HF model.

    Dropout off and the CUDA-only fusions off (the model.py builder turns fusions back on only where they
    exist); `overrides` replace TransformerConfig fields (e.g. recompute, bf16). A MoE model gets
    convert_moe.config_kwargs (its layer pattern in `moe_layer_freq`: build it with get_gpt_decoder_block_spec).
    """
    s = model_shape(hf_config)
    check_parallel(s, tp_size, pp_size, ep_size)
    tc = dict(
        num_layers=s.num_layers, hidden_size=s.hidden, ffn_hidden_size=s.ffn, num_attention_heads=s.heads,
        num_query_groups=s.kv_heads, kv_channels=s.head_dim, normalization="RMSNorm", layernorm_epsilon=s.rms_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm, rotary_interleaved=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
    )
    if s.moe is not None:
        tc.update(convert_moe.config_kwargs(s.moe, ep_size))
    tc.update(overrides)
    gpt = dict(
        vocab_size=padded_vocab_size(s.vocab, tp_size, vocab_multiple), max_sequence_length=s.max_positions,
        position_embedding_type="rope", rotary_base=s.rope_theta, share_embeddings_and_output_weights=s.tied,
        parallel_output=True, **s.rope_kwargs,
    )
    spec = dict(qk_layernorm=s.qk_norm, normalization="RMSNorm")
    return tc, gpt, spec


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global layer numbers held by pipeline stage pp_rank (megatron's even split)."""
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


# ---- HF <-> megatron full (TP=1, global layer numbers) ------------------------------------------------------

_SAME = {  # per-layer names that only change their spelling
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "decoder.final_layernorm.weight": "model.norm.weight",
           "output_layer.weight": "lm_head.weight"}


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) -> megatron's grouped linear_qkv."""
    tail = q.shape[1:]
    g, per = s.kv_heads, s.heads // s.kv_heads
    return torch.cat([q.reshape(g, per * s.head_dim, *tail), k.reshape(g, s.head_dim, *tail), v.reshape(g, s.head_dim, *tail)],
                     dim=1).reshape(-1, *tail)


def _split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tail = qkv.shape[1:]
    g, per = s.kv_heads, s.heads // s.kv_heads
    q, k, v = qkv.reshape(g, (per + 2) * s.head_dim, *tail).split([per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_full(hf: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF state dict -> megatron full layout (global layer numbers, TP=1, unpadded vocab).

    Layers may be a subset (a pipeline stage's); lm_head is ignored for tied embeddings.
    """
    if shape.moe is not None:
        hf = convert_moe.checkpoint_names(hf)  # a transformers model.state_dict() holds the experts fused
    out: dict[str, torch.Tensor] = {}
    for mname, hname in _GLOBAL.items():
        if hname in hf and not (shape.tied and mname == "output_layer.weight"):
            out[mname] = hf[hname]
    layers = sorted({int(m.group(2)) for m in map(_LAYER.match, hf) if m})
    for i in layers:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mn, hn in _SAME.items():
            if h + hn in hf:
                out[m + mn] = hf[h + hn]
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _merge_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], shape)
        if shape.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _merge_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], shape)
        if shape.moe is not None and shape.moe.layers[i]:
            out.update(convert_moe.layer_to_full(hf, i, shape.moe))
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0)
    return out


def full_to_hf(full: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Megatron full layout (global layer numbers, TP=1; padded vocab rows are cut) -> HF names and shapes."""
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name in _GLOBAL:
            if name == "output_layer.weight" and shape.tied:
                continue  # the tied copy on the last stage: HF keeps only embed_tokens
            out[_GLOBAL[name]] = t[: shape.vocab] if tp_kind(name) == "vocab" else t
            continue
        m = _LAYER.match(name)
        if not m or m.group(1) != "decoder.layers.":
            raise ValueError(f"full_to_hf: unexpected megatron name {name!r}")
        h, rest = f"model.layers.{m.group(2)}.", m.group(3)
        moe = convert_moe.full_to_hf(m.group(2), rest, t) if shape.moe is not None else None
        if moe is not None:
            out.update(moe)
        elif rest in _SAME:
            out[h + _SAME[rest]] = t
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(t, shape)):
                out[f"{h}self_attn.{proj}.{kind}"] = part.contiguous()
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        else:
            raise ValueError(f"full_to_hf: unexpected megatron name {name!r}")
    return out


# ---- megatron full <-> one tensor-parallel rank -------------------------------------------------------------

def tp_kind(name: str) -> str:
    """How a megatron parameter is cut over the TP group: vocab (dim 0, padded), column (dim 0), gated (fc1),
    row (dim 1) or replicated."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"  # whole query groups per rank, as num_key_value_heads % tp_size == 0
    if name.endswith("linear_fc1.weight"):
        return "gated"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if name.endswith(("layernorm.weight", "norm.weight", "mlp.router.weight")):
        return "replicated"
    raise ValueError(f"tp_kind: no tensor-parallel rule for megatron parameter {name!r}")


def split_tp(name: str, full: torch.Tensor, shape: ModelShape, tp_rank: int, tp_size: int, vocab_multiple: int = 1) -> torch.Tensor:
    """This TP rank's shard of one megatron-full tensor (a contiguous copy)."""
    kind = tp_kind(name)
    if kind == "replicated" or (tp_size == 1 and kind != "vocab"):
        return full.clone()
    if kind == "vocab":
        pad = padded_vocab_size(full.shape[0], tp_size, vocab_multiple) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])], dim=0)
        return full.chunk(tp_size, dim=0)[tp_rank].clone()
    if kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=0 if kind == "column" else 1)[tp_rank].clone()


def merge_tp(name: str, parts: Sequence[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """The megatron-full tensor from the TP shards of one parameter, in TP-rank order (vocab padding cut off)."""
    kind = tp_kind(name)
    if kind == "replicated":
        return parts[0].clone()
    if kind == "vocab":
        return torch.cat(list(parts), dim=0)[: shape.vocab]
    if kind == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(parts), dim=0 if kind == "column" else 1)


# ---- pipeline stages ----------------------------------------------------------------------------------------

def layer_index(name: str) -> int | None:
    """The layer number in a HF (`model.layers.N.`) or megatron (`decoder.layers.N.`) name; None outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None


def renumber(name: str, offset: int) -> str:
    """The name with its layer number shifted by offset (stage-local <-> global); other names unchanged."""
    m = _LAYER.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}.{m.group(3)}" if m else name


def full_to_stage(full: Mapping[str, torch.Tensor], shape: ModelShape, pp_rank: int, pp_size: int) -> dict[str, torch.Tensor]:
    """Pipeline stage pp_rank's part of the megatron-full dict, its layers renumbered from 0."""
    layers = stage_layers(shape.num_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m:
            if int(m.group(2)) in layers:
                out[renumber(name, -layers.start)] = t
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = t
            if last and shape.tied and pp_size > 1:  # megatron's last stage keeps its own copy of a tied embedding
                out["output_layer.weight"] = t
        elif last:
            out[name] = t
    return out


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1, ep_rank: int = 0, ep_size: int = 1, vocab_multiple: int = 1) -> dict[str, torch.Tensor]:
    """HF state dict (all of it, or at least this stage's tensors) -> this rank's megatron parameters.

    For a tied model the embedding goes to the first stage and, with pp_size > 1, as `output_layer.weight`
    to the last. A MoE model's rank holds the experts of its EP rank, numbered from 0 (convert_moe.full_to_ep).
    """
    check_parallel(shape, tp_size, pp_size, ep_size)
    stage = full_to_stage(hf_to_full(hf, shape), shape, pp_rank, pp_size)
    if shape.moe is not None:
        stage = convert_moe.full_to_ep(stage, shape.moe, ep_rank, ep_size)
    return {name: split_tp(name, t, shape, tp_rank, tp_size, vocab_multiple) for name, t in stage.items()}


def megatron_to_hf(shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Every rank's megatron parameters, `shards[pp_rank][tp_rank]`, -> the HF state dict (lm_head omitted when tied)."""
    pp_size = len(shards)
    full: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        offset = stage_layers(shape.num_layers, pp_rank, pp_size).start
        for name in stage[0]:
            if name == "output_layer.weight" and shape.tied:
                continue  # the last stage's copy of the embedding: the first stage's is the one
            full[renumber(name, offset)] = merge_tp(name, [tp[name] for tp in stage], shape)
    return full_to_hf(full, shape)


def megatron_names(state: Mapping[str, Any], *, te: bool) -> dict[str, Any]:
    """Local-spec names -> Transformer Engine spec names (te=True), whose linear layers own the pre-norms:
    `input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`,
    `pre_mlp_layernorm.weight` -> `mlp.linear_fc1.layer_norm_weight` (dense layers only: a MoE layer keeps its
    pre_mlp_layernorm). te=False: the reverse."""
    pairs = [("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")]
    out = {}
    for name, t in state.items():
        for local, fused in pairs:
            a, b = (local, fused) if te else (fused, local)
            if te and a == "pre_mlp_layernorm.weight" and name[: -len(a)] + "mlp.router.weight" in state:
                continue
            if name.endswith("." + a) and name.startswith("decoder.layers."):
                name = name[: -len(a)] + b
                break
        out[name] = t
    return out
