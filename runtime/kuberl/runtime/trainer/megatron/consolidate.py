"""A Megatron-backend checkpoint as one HF state dict, in this process (no process group, no megatron-core import).

The trainer's megatron checkpoints (backend.py `megatron_write_state`) hold one `megatron-tp{t}-pp{p}[-ep{e}].pt`
per (tp, pp, ep) rank (its GPTModel `state_dict()` under "model", its optimizer under "optimizer") and
`megatron.json`: the tensor/pipeline/expert sizes and the HF model config. `read_hf_state(path)` loads every
shard, merges the EP ranks' experts (convert_moe.merge_ep), the TP shards and the pipeline stages
(convert.megatron_to_hf) and returns the HF checkpoint names and shapes the trainer publishes (a MoE model's
experts per expert, as save_pretrained writes them; lm_head also for a tied model, as the FSDP path's state
dict has it). For tools outside the trainer (evaluation, export): it holds the whole model in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kuberl.runtime.trainer.megatron import convert, convert_moe

LAYOUT_FILE = "megatron.json"


def shard_file(tp_rank: int, pp_rank: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """A checkpoint's model + optimizer file of one (tp, pp, ep) rank (no ep part without expert parallelism)."""
    return f"megatron-tp{tp_rank}-pp{pp_rank}" + (f"-ep{ep_rank}" if ep_size > 1 else "") + ".pt"


def read_layout(path: str | Path) -> dict | None:
    """The layout a Megatron checkpoint was written with (tensor, pipeline, expert; model: the HF config); None for FSDP."""
    file = Path(path) / LAYOUT_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def _params(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A GPTModel state_dict's parameters under local-spec names (no `_extra_state` or other non-tensor entries)."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    return convert.megatron_names(tensors, te=False)


def read_hf_state(path: str | Path, hf_config: Any = None) -> dict[str, torch.Tensor]:
    """The full HF state dict of Megatron checkpoint `path`; `hf_config` (a transformers config or config.json dict) only for
    checkpoints whose megatron.json does not hold the model's config."""
    path = Path(path)
    layout = read_layout(path)
    if layout is None:
        raise ValueError(f"{path}: no {LAYOUT_FILE}: not a checkpoint of trainer.backend megatron")
    cfg = layout.get("model") or hf_config
    if cfg is None:
        raise ValueError(f"{path}/{LAYOUT_FILE} holds no model config (a checkpoint written before it did): pass hf_config, "
                         "the model's config.json")
    shape = convert.model_shape(cfg)
    tp, pp, ep = int(layout["tensor"]), int(layout["pipeline"]), int(layout.get("expert", 1))
    shards = []
    for p in range(pp):
        per_tp = []
        for t in range(tp):
            per_ep = []
            for e in range(ep):
                file = path / shard_file(t, p, e, ep)
                if not file.is_file():
                    raise FileNotFoundError(f"{file}: missing from Megatron checkpoint {path.name} (tensor {tp}, pipeline {pp}, expert {ep})")
                per_ep.append(_params(torch.load(file, map_location="cpu", weights_only=False)["model"]))
            per_tp.append(convert_moe.merge_ep(per_ep, shape.moe) if shape.moe is not None else per_ep[0])
        shards.append(per_tp)
    out = convert.megatron_to_hf(shards, shape)
    if shape.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
