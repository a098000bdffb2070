"""The Megatron backend's end-of-run weight hash, one parameter at a time (the FSDP path's persist.full_weights_digest).

weights.digest_state reads a state dict's tensors in sorted name order, one at a time. `StreamedHF` is such a state
dict of the trained model's HF tensors (the names and shapes the trainer publishes; lm_head also for a tied model, as
gather_hf_state gives them) whose entries are gathered only when read: the megatron parameter behind an HF name is
all-gathered over its tensor-parallel group (an expert's also over its expert-parallel group) and, under pipeline
parallelism, broadcast from its stage to the other stages. A megatron parameter that holds several HF tensors
(q/k/v, gate/up) is kept until its last HF name is read, so a rank holds about one parameter, on the CPU, never the
whole state (which ran out of accelerator memory from ~14B parameters). Every rank reads every name in the same order,
so the collectives line up within each data-parallel replica's groups, and every rank gets the same digest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

Entry = tuple[str, tuple[str, ...], tuple[int, ...], torch.dtype]  # backend._publish_plan: name, global names, full shape, dtype


class StreamedHF(Mapping):
    """HF name -> the full tensor (CPU), gathered when read (collective: every rank reads the same names in the same order).

    `stages`: backend._publish_plan() (every stage's entries); `tp_full(name, param)` and `ep_parts(full)`: the backend's
    gathers over the TP and EP groups; `params`: this stage's parameters under local-spec names.
    """

    def __init__(self, mm: Any, stages: list[list[Entry]], params: dict[str, torch.Tensor], tp_full: Callable, ep_parts: Callable,
                 device: torch.device):
        from kuberl.runtime.trainer.megatron import convert

        self.mm, self.stages, self.params, self.tp_full, self.ep_parts, self.device = mm, stages, params, tp_full, ep_parts, device
        self.index: dict[str, tuple[int, int, str]] = {}  # HF name -> (stage, entry, the HF name the entry yields it under)
        for s, entries in enumerate(stages):
            for i, (_, gnames, shape, dtype) in enumerate(entries):
                for g in gnames:
                    for h in convert.full_to_hf({g: torch.empty(shape, dtype=dtype, device="meta")}, mm.shape):
                        self.index[h] = (s, i, h)
        if mm.shape.tied and "model.embed_tokens.weight" in self.index:
            self.index["lm_head.weight"] = self.index["model.embed_tokens.weight"]
        self.reads: dict[tuple[int, int], int] = {}  # entry -> HF names left to read
        for s, i, _ in self.index.values():
            self.reads[(s, i)] = self.reads.get((s, i), 0) + 1
        self.cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, name: str) -> torch.Tensor:
        s, i, hname = self.index[name]
        if (s, i) not in self.cache:
            self.cache[(s, i)] = self._fetch(s, i)
        out = self.cache[(s, i)][hname]
        self.reads[(s, i)] -= 1
        if self.reads[(s, i)] == 0:
            del self.cache[(s, i)]
        return out

    def _fetch(self, s: int, i: int) -> dict[str, torch.Tensor]:
        """Collective: entry i of stage s as HF tensors, on every rank of this pipeline."""
        from megatron.core import parallel_state as ps

        from kuberl.runtime.trainer.megatron import convert

        name, gnames, shape, dtype = self.stages[s][i]
        if ps.get_pipeline_model_parallel_rank() == s:
            parts = [self.tp_full(name, self.params[name])]
            if len(gnames) > 1:  # an expert parameter: one per EP rank
                parts = self.ep_parts(parts[0])
        else:
            parts = [torch.empty(shape, dtype=dtype) for _ in gnames]
        if len(self.stages) > 1:
            group = ps.get_pipeline_model_parallel_group()
            src = dist.get_process_group_ranks(group)[s]
            moved = []
            for t in parts:
                t = t.to(self.device)
                dist.broadcast(t, src=src, group=group)
                moved.append(t.cpu())
            parts = moved
        out: dict[str, torch.Tensor] = {}
        for g, t in zip(gnames, parts):
            out.update(convert.full_to_hf({g: t}, self.mm.shape))
        return out
