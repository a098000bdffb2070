"""Mixture-of-experts part of the HF <-> megatron-core conversion (Qwen3-MoE): pure functions, no process group.

convert.py calls these for a model whose `ModelShape.moe` is set; they only know about the MLP of a MoE
layer (router and experts), everything else (attention, norms, embeddings, pipeline stages, TP splits)
is convert.py's.

Names of one MoE layer `i`:

* **HF checkpoint** (what `save_pretrained` writes, vLLM and `from_pretrained` load, and the trainer publishes):
  `model.layers.i.mlp.gate.weight` [E, hidden] (the router), and per expert e
  `model.layers.i.mlp.experts.e.{gate,up}_proj.weight` [ffn, hidden], `...down_proj.weight` [hidden, ffn].
  transformers 5 holds the experts fused in memory (`mlp.experts.gate_up_proj` [E, 2 ffn, hidden] =
  `[gate; up]` per expert, `mlp.experts.down_proj` [E, hidden, ffn]); `checkpoint_names` turns a
  `model.state_dict()` into the checkpoint names, `fused_names` back.
* **megatron** (local layer spec with `num_experts`, `SequentialMLP`): `decoder.layers.i.mlp.router.weight`
  and `decoder.layers.i.mlp.experts.local_experts.j.linear_fc{1,2}.weight`, fc1 = `[gate; up]` as the dense
  gated MLP. In convert.py's "full" layout j is the global expert number; on expert-parallel rank r of
  ep_size, j counts this rank's experts from 0: global expert r * E / ep_size + j (megatron's
  `MoELayer.local_expert_indices`). `full_to_ep` cuts the experts of one EP rank, `merge_ep` puts the
  EP ranks' dicts back together. The router is replicated on every rank.

Routing (megatron `topk_routing_with_score_function`, moe_utils.py:608): HF Qwen3-MoE takes softmax over all
experts, the top k, and with `norm_topk_prob` divides by their sum. megatron with `moe_router_pre_softmax`
takes softmax then top k (= HF without normalisation); without it, top k of the logits then softmax over
those k, which is exactly the normalised HF weights. So `moe_router_pre_softmax = not norm_topk_prob`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MOE_MODEL_TYPES = ("qwen3_moe",)

_HF_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_MG_EXPERT = re.compile(r"^((?:.*\.)?mlp\.experts\.local_experts\.)(\d+)\.(linear_fc1\.weight|linear_fc2\.weight)$")


@dataclass(frozen=True)
class MoEShape:
    """What conversion needs to know about the MoE layers (from `moe_shape(hf_config)`)."""

    num_experts: int
    topk: int
    ffn: int  # moe_intermediate_size: each expert's hidden size
    norm_topk: bool  # norm_topk_prob: the top-k routing weights sum to 1
    layers: tuple[bool, ...]  # per global layer: True for a MoE layer, False for a dense MLP


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def moe_shape(hf_config: Any, model_type: str, num_layers: int) -> MoEShape:
    """The MoE part of a Qwen3-MoE config; ValueError names the field megatron cannot do."""
    experts = _get(hf_config, "num_experts", None) or _get(hf_config, "num_local_experts", None)
    if not experts:
        raise ValueError(f"{model_type}: num_experts is missing or 0")
    experts, topk = int(experts), int(_get(hf_config, "num_experts_per_tok"))
    if not 1 <= topk <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok {topk} must be between 1 and num_experts {experts}")
    norm = bool(_get(hf_config, "norm_topk_prob", False))
    if topk == 1 and norm:
        # HF's weight is then always 1 (no router gradient); megatron needs moe_router_pre_softmax at top-1
        # (transformer_config.py:1631), which gives softmax(all logits)[top] instead.
        raise ValueError(f"{model_type}: num_experts_per_tok 1 with norm_topk_prob is not supported (megatron routes top-1 with "
                         "pre-softmax weights; HF's normalised weight is always 1)")
    for name in ("shared_expert_intermediate_size", "n_shared_experts"):
        if _get(hf_config, name, None):
            raise ValueError(f"{model_type}: {name} (shared experts) is not supported")
    step = int(_get(hf_config, "decoder_sparse_step", 1) or 1)
    only = [int(i) for i in (_get(hf_config, "mlp_only_layers", None) or [])]
    bad = [i for i in only if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{model_type}: mlp_only_layers {bad} are not layers of a {num_layers}-layer model")
    # Qwen3MoeDecoderLayer: a MoE MLP where layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0
    layers = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
    if not any(layers):
        raise ValueError(f"{model_type}: decoder_sparse_step {step} / mlp_only_layers {only} leave no MoE layer")
    return MoEShape(num_experts=experts, topk=topk, ffn=int(_get(hf_config, "moe_intermediate_size")), norm_topk=norm, layers=layers)


def check_parallel(model_type: str, moe: MoEShape, tp_size: int, ep_size: int) -> None:
    """ValueError when the experts cannot be cut over ep_size (and tp_size) ranks."""
    if moe.num_experts % ep_size:
        raise ValueError(f"{model_type}: num_experts {moe.num_experts} is not divisible by expert parallel size {ep_size}")
    if tp_size > 1:
        # MoELayer.forward (moe_layer.py:379) refuses to train with tensor parallelism but without sequence
        # parallelism, which this backend does not implement.
        raise ValueError(f"{model_type}: tensor parallel size {tp_size} with a mixture-of-experts model needs sequence parallelism, "
                         "which the Megatron backend does not implement: use trainer.parallelism.tensor 1 (and expert/pipeline/data)")


def config_kwargs(moe: MoEShape, ep_size: int) -> dict[str, Any]:
    """TransformerConfig fields of the MoE layers: HF's routing exactly, no auxiliary loss, no token dropping."""
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.ffn,
        moe_router_score_function="softmax", moe_router_pre_softmax=not moe.norm_topk,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_expert_capacity_factor=None,
        # allgather: gloo has no CUDA streams for the alltoall dispatcher (token_dispatcher.py:445); it needs
        # the same token count on every rank of the tensor x expert group (model.py pads the micro-batches).
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        moe_layer_freq=[int(x) for x in moe.layers], expert_model_parallel_size=ep_size,
    )


def hf_expert_index(name: str) -> int | None:
    """The expert number in a HF checkpoint name (`model.layers.i.mlp.experts.e.*`); None for any other name."""
    m = _HF_EXPERT.match(name)
    return int(m.group(2)) if m else None


def is_expert(name: str) -> bool:
    """A megatron expert parameter (sharded over expert parallelism, reduced over the expert-data-parallel group)."""
    return _MG_EXPERT.match(name) is not None


def expert_index(name: str) -> int | None:
    m = _MG_EXPERT.match(name)
    return int(m.group(2)) if m else None


def renumber_expert(name: str, offset: int) -> str:
    """A megatron expert name with its expert number shifted by offset (EP-local <-> global)."""
    m = _MG_EXPERT.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}.{m.group(3)}" if m else name


# ---- HF <-> megatron full, one layer's MLP ------------------------------------------------------------------

def checkpoint_names(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused in-memory experts -> per-expert checkpoint names (other names unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        m = _HF_FUSED.match(name)
        if not m:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m.group(1)}{e}.gate_proj.weight"], out[f"{m.group(1)}{e}.up_proj.weight"] = gate, up
    return out


def fused_names(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint names -> transformers' fused in-memory experts (what `model.state_dict()` holds)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in hf.items():
        m = _HF_EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, per in experts.items():
        order = sorted(per)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order])
        out[prefix + "down_proj"] = torch.stack([per[e]["down_proj"] for e in order])
    return out


def layer_to_full(hf: Mapping[str, torch.Tensor], layer: int, moe: MoEShape) -> dict[str, torch.Tensor]:
    """Router and experts of HF MoE layer `layer` (checkpoint names) -> megatron-full names (global expert numbers).

    Experts absent from `hf` are skipped (a rank reads only its EP rank's experts; model.load_hf_state checks
    that every parameter gets a weight)."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    out = {m + "router.weight": hf[h + "gate.weight"]}
    for e in range(moe.num_experts):
        x = f"{h}experts.{e}."
        if x + "down_proj.weight" not in hf:
            continue
        out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]], dim=0)
        out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = hf[x + "down_proj.weight"]
    return out


def full_to_hf(layer: str, rest: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """One megatron-full MoE tensor (`rest` after `decoder.layers.{layer}.`) -> HF checkpoint tensors; None if not a MoE name."""
    h = f"model.layers.{layer}.mlp."
    if rest == "mlp.router.weight":
        return {h + "gate.weight": t}
    m = _MG_EXPERT.match(rest)
    if not m:
        return None
    x = f"{h}experts.{m.group(2)}."
    if m.group(3) == "linear_fc2.weight":
        return {x + "down_proj.weight": t}
    gate, up = t.chunk(2, dim=0)
    return {x + "gate_proj.weight": gate.contiguous(), x + "up_proj.weight": up.contiguous()}


# ---- expert parallelism ---------------------------------------------------------------------------------------

def full_to_ep(stage: Mapping[str, torch.Tensor], moe: MoEShape, ep_rank: int, ep_size: int) -> dict[str, torch.Tensor]:
    """The tensors EP rank ep_rank holds: its experts (renumbered from 0) and every non-expert tensor."""
    per = moe.num_experts // ep_size
    lo = ep_rank * per
    out = {}
    for name, t in stage.items():
        e = expert_index(name)
        if e is None:
            out[name] = t
        elif lo <= e < lo + per:
            out[renumber_expert(name, -lo)] = t
    return out


def merge_ep(per_rank: Sequence[Mapping[str, torch.Tensor]], moe: MoEShape) -> dict[str, torch.Tensor]:
    """The EP ranks' dicts (in EP-rank order) -> one dict with global expert numbers (non-expert tensors from rank 0)."""
    per = moe.num_experts // len(per_rank)
    out = {name: t for name, t in per_rank[0].items() if not is_expert(name)}
    for r, d in enumerate(per_rank):
        for name, t in d.items():
            if is_expert(name):
                out[renumber_expert(name, r * per)] = t
    return out
