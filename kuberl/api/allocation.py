"""AReaL's allocation shorthand, e.g. `sglang:d4+fsdp:d4` or `vllm:d2t2+megatron:d2p2t2`.

Called by RLExperimentSpec's validator: the shorthand expands into rollout.{engine, replicas,
tensorParallelSize, pipelineParallelSize, accelerator.count} and trainer.{backend, nodes,
accelerator.count, parallelism}. A field the manifest sets explicitly must agree with it, else the
spec is rejected naming the field (the FieldError carries its value; the CRD's CEL rules say the same
words); the one exception is rollout.replicas: the shorthand's d is
only its default (an explicit count, e.g. from `kubectl scale`, wins). megatron takes d, t, p and e (issue #13):
e (expert parallel) is not a factor of the world size (d x t x p x c) but cuts the experts over the d
data-parallel ranks, so it must divide d, as in AReaL. c (context parallel) is a factor of the world size with fsdp
(Ulysses; `fsdp:d2c2`: 4 ranks, 2 replicas of 2) and with megatron (`megatron:d1c2`, megatron-core's CP groups); not with
e above 1 (megatron does not run a MoE model context parallel), and fsdp refuses e above 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kuberl.api.v1alpha1 import (
    ALLOCATION_CONTEXT_EXPERT,
    ALLOCATION_DIM_TWICE,
    ALLOCATION_DIM_ZERO,
    ALLOCATION_EXPERT_DIVIDE,
    ALLOCATION_EXPERT_NEED_MEGATRON,
    ALLOCATION_EXPERT_TENSOR,
    ALLOCATION_FSDP_ONLY_D,
    ALLOCATION_NODE_SPLIT,
    ALLOCATION_REPLICAS_RANGE,
    FieldError,
    allocation_disagrees,
)

if TYPE_CHECKING:
    from kuberl.api.v1alpha1 import RLExperimentSpec

GPUS_PER_NODE = 8  # a trainer spanning more accelerators than this is split into nodes of 8


@dataclass(frozen=True)
class Allocation:
    engine: str
    rollout: dict[str, int]  # d, t, p
    backend: str
    trainer: dict[str, int]  # d, t, p, c, e

    @property
    def rollout_accelerators(self) -> int:
        return self.rollout["t"] * self.rollout["p"]

    @property
    def trainer_world_size(self) -> int:
        t = self.trainer
        return t["d"] * t["t"] * t["p"] * t["c"]


def _dims(text: str, allowed: str) -> dict[str, int]:
    dims = {k: 1 for k in allowed}
    seen = set()
    if not re.fullmatch(r"([a-z][0-9]+)+", text):
        raise ValueError(f"allocation: {text!r} is not a list of dimensions like d4 or d2t2 (a letter, then a number)")
    for key, value in re.findall(r"([a-z])([0-9]+)", text):
        if key not in allowed:
            raise ValueError(f"allocation: dimension {key!r} is not allowed in {text!r} (allowed: {', '.join(allowed)})")
        if key in seen:
            raise ValueError(ALLOCATION_DIM_TWICE)  # the CRD's CEL rule says the same
        if int(value) < 1:
            raise ValueError(ALLOCATION_DIM_ZERO)
        seen.add(key)
        dims[key] = int(value)
    return dims


def parse_allocation(text: str) -> Allocation:
    """Parse `<engine>:<dims>+<backend>:<dims>`; raises ValueError naming what is wrong."""
    m = re.fullmatch(r"(sglang|vllm):([a-z0-9]+)\+(fsdp|megatron):([a-z0-9]+)", text)
    if not m:
        raise ValueError(f"allocation {text!r} is not of the form <sglang|vllm>:d<N>[t<N>][p<N>]+<fsdp|megatron>:d<N>[t<N>][p<N>][c<N>][e<N>]")
    engine, rdims, backend, tdims = m.groups()
    alloc = Allocation(engine, _dims(rdims, "dtp"), backend, _dims(tdims, "dtpce"))
    if backend == "fsdp" and (alloc.trainer["t"], alloc.trainer["p"]) != (1, 1):
        raise ValueError(ALLOCATION_FSDP_ONLY_D)
    return alloc


def apply_allocation(spec: RLExperimentSpec) -> None:
    """Expand spec.allocation into the rollout and trainer fields, rejecting contradictions."""
    try:
        alloc = parse_allocation(spec.allocation or "")
    except ValueError as exc:
        raise FieldError("spec.allocation", spec.allocation, str(exc)) from None
    # AReaL's grammar parses; what no trainer implements yet is refused here (and, but for e dividing d, by the CRD's CEL rules).
    if alloc.trainer["c"] > 1 and alloc.trainer["e"] > 1:
        raise FieldError("spec.allocation", spec.allocation, ALLOCATION_CONTEXT_EXPERT)
    if alloc.trainer["e"] > 1 and alloc.backend != "megatron":
        raise FieldError("spec.allocation", spec.allocation, ALLOCATION_EXPERT_NEED_MEGATRON)
    if alloc.trainer["e"] > 1 and alloc.trainer["t"] > 1:
        raise FieldError("spec.allocation", spec.allocation, ALLOCATION_EXPERT_TENSOR)
    if alloc.trainer["d"] % alloc.trainer["e"]:
        raise FieldError("spec.allocation", spec.allocation, ALLOCATION_EXPERT_DIVIDE)
    r, t = spec.rollout, spec.trainer
    world = alloc.trainer_world_size
    per_node = t.accelerator.count if "count" in t.accelerator.model_fields_set else min(world, GPUS_PER_NODE)
    if per_node == 0 or world % per_node:
        raise FieldError("spec.trainer.accelerator.count", per_node,
                         ALLOCATION_NODE_SPLIT)
    # The shorthand's rollout d is only the default replica count: an explicit spec.rollout.replicas
    # wins, so `kubectl scale`, an HPA and the autoscaler (all through the /scale subresource, which
    # writes spec.rollout.replicas) can move it; the operator writes the resolved count there once.
    explicit_replicas = "replicas" in r.model_fields_set
    wanted = [
        (r, "engine", "rollout.engine", alloc.engine),
        *([] if explicit_replicas else [(r, "replicas", "rollout.replicas", alloc.rollout["d"])]),
        (r, "tensor_parallel_size", "rollout.tensorParallelSize", alloc.rollout["t"]),
        (r, "pipeline_parallel_size", "rollout.pipelineParallelSize", alloc.rollout["p"]),
        (r.accelerator, "count", "rollout.accelerator.count", alloc.rollout_accelerators),
        (t, "backend", "trainer.backend", alloc.backend),
        (t, "nodes", "trainer.nodes", world // per_node),
        (t.accelerator, "count", "trainer.accelerator.count", per_node),
        (t.parallelism, "data", "trainer.parallelism.data", alloc.trainer["d"]),
        (t.parallelism, "tensor", "trainer.parallelism.tensor", alloc.trainer["t"]),
        (t.parallelism, "pipeline", "trainer.parallelism.pipeline", alloc.trainer["p"]),
        (t.parallelism, "context", "trainer.parallelism.context", alloc.trainer["c"]),
        (t.parallelism, "expert", "trainer.parallelism.expert", alloc.trainer["e"]),
    ]
    for obj, attr, path, value in wanted:
        if attr in obj.model_fields_set and getattr(obj, attr) != value:
            raise FieldError(f"spec.{path}", getattr(obj, attr), allocation_disagrees(path))
    for obj, attr, _, value in wanted:
        object.__setattr__(obj, attr, value)
    if r.autoscaling.enabled and not explicit_replicas and not (r.autoscaling.min_replicas <= r.replicas <= r.autoscaling.max_replicas):
        raise FieldError("spec.rollout.replicas", r.replicas, ALLOCATION_REPLICAS_RANGE)
