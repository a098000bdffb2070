"""Pins: what an experiment keeps for its lifetime, so that an operator upgrade does not restart it.

Called by the builders (the pinned runtime image tag, repository and bus run come from the
RLExperiment's annotations) and by kuberl.operator.lifecycle (the pins written once, at the first
reconcile; `keep_pinned` between reading a child and applying the rebuilt one). A new operator
version renders other pod templates (a new default image tag, probes, env, experiment.yaml with new
model defaults); applying them would roll every engine and re-create every trainer Job. So a pinned
child keeps its live template (or its data) until the user's own spec changes, or until the user
edits a pin annotation on the RLExperiment, which is the explicit opt-in to roll it.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import kuberl
from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, stable_hash, with_spec_hash

# Spec fields that change how many pods run, not what they run: scaling, suspending, restarts and
# TTL never re-render a pod template.
OPERATIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "": ("suspend", "ttlSecondsAfterFinished", "failurePolicy"),
    "rollout": ("replicas", "autoscaling"),
}
# (apiVersion, kind) -> the part kept from the live object while the child is pinned.
PINNED_PARTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("apps/v1", "StatefulSet"): ("spec", "template"),
    ("apps/v1", "Deployment"): ("spec", "template"),  # the sandbox server (workflow.sandbox.placement pod)
    ("batch/v1", "Job"): ("spec", "template"),
    ("v1", "ConfigMap"): ("data",),  # experiment.yaml: a restarted pod must read what its peers read
    ("v1", "Secret"): ("data",),  # the bus credentials and nats.conf the NATS servers run with
}
_DEFAULT_IMAGE = re.compile(r"^(?P<repository>.+)/runtime-(?:vllm|sglang|npu|cpu):(?P<version>[^@/]+)$")


def runtime_version(exp: RLExperiment) -> str:
    """The tag of the default runtime images: pinned on the experiment, else this operator's version."""
    return (exp.metadata.annotations or {}).get(L.RUNTIME_VERSION_ANNOTATION) or kuberl.__version__


def runtime_repository(exp: RLExperiment) -> str | None:
    """The repository of the default runtime images pinned on the experiment (None: the configured one)."""
    return (exp.metadata.annotations or {}).get(L.RUNTIME_REPOSITORY_ANNOTATION) or None


def _containers(obj: Obj | None) -> list[Obj]:
    pod = (((obj or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    return [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]


def pins_for(exp: RLExperiment, repository: str, live_workloads: list[Obj]) -> dict[str, str]:
    """The pin annotations the experiment lacks, to write once (empty: all pinned already).

    A new experiment pins this operator (`kuberl.__version__`, `repository`) and a run of its own
    namespace and uid. An experiment whose workloads an earlier operator already runs (no pins yet)
    pins what they run: the tag and repository of their default runtime image, and no run (""), as
    their pods use the plain bus names of that operator.
    """
    have = exp.metadata.annotations or {}
    images = [c.get("image") or "" for w in live_workloads for c in _containers(w)]
    found = next((m for m in map(_DEFAULT_IMAGE.match, images) if m), None)
    env = {e.get("name"): e.get("value") for w in live_workloads for c in _containers(w) for e in c.get("env") or []}
    if live_workloads:
        wanted = {
            L.RUNTIME_VERSION_ANNOTATION: found["version"] if found else kuberl.__version__,
            L.RUNTIME_REPOSITORY_ANNOTATION: found["repository"] if found else repository,
            L.BUS_RUN_ANNOTATION: env.get("KUBERL_BUS_RUN") or "",
        }
    else:
        wanted = {
            L.RUNTIME_VERSION_ANNOTATION: kuberl.__version__,
            L.RUNTIME_REPOSITORY_ANNOTATION: repository,
            L.BUS_RUN_ANNOTATION: naming.default_bus_run(exp),
        }
    return {k: v for k, v in wanted.items() if k not in have}


def with_pins(exp: RLExperiment, pins: dict[str, str]) -> RLExperiment:
    """`exp` with `pins` added to its annotations (what the experiment reads once the patch landed)."""
    if not pins:
        return exp
    meta = exp.metadata.model_copy(update={"annotations": {**(exp.metadata.annotations or {}), **pins}})
    return exp.model_copy(update={"metadata": meta})


def template_inputs(exp: RLExperiment) -> str:
    """Hash of what the user asked for (the spec fields set in the object, without OPERATIONAL_FIELDS)
    and of the pins: equal inputs, equal pod templates as far as the user is concerned."""
    spec = exp.spec.model_dump(by_alias=True, exclude_unset=True, mode="json")
    for section, fields in OPERATIONAL_FIELDS.items():
        target = spec if not section else spec.get(section) or {}
        for f in fields:
            target.pop(f, None)
    pins = {k: (exp.metadata.annotations or {}).get(k) for k in L.PIN_ANNOTATIONS}
    return stable_hash({"spec": spec, "pins": pins})


def generation(exp: RLExperiment) -> str:
    return str((exp.metadata.model_extra or {}).get("generation") or "")


def stamp(obj: Obj, exp: RLExperiment) -> Obj:
    """The pin annotations of `exp` and its template inputs and generation on a pinned child."""
    annotations = obj["metadata"].setdefault("annotations", {})
    for key in L.PIN_ANNOTATIONS:
        value = (exp.metadata.annotations or {}).get(key)
        if value is not None:
            annotations[key] = value
    annotations[L.TEMPLATE_INPUTS_ANNOTATION] = template_inputs(exp)
    annotations[L.TEMPLATE_GENERATION_ANNOTATION] = generation(exp)
    return obj


def must_render(built: Obj, live: Obj) -> str | None:
    """Why the live child must take the newly built template (None: it keeps its own).

    A pin annotation the user changed on the experiment (the opt-in), or a spec change of the user's:
    another generation *and* other template inputs (kubectl scale bumps the generation but not the
    inputs; a new CRD default changes the inputs but not the generation). A child without the
    annotations was made by an operator before pins: it keeps its template.
    """
    have = (live.get("metadata") or {}).get("annotations") or {}
    want = (built.get("metadata") or {}).get("annotations") or {}
    for key in L.PIN_ANNOTATIONS:
        if key in have and key in want and have[key] != want[key]:
            return f"{key} changed from {have[key]!r} to {want[key]!r}"
    gen, inputs = L.TEMPLATE_GENERATION_ANNOTATION, L.TEMPLATE_INPUTS_ANNOTATION
    if gen in have and have.get(gen) != want.get(gen) and have.get(inputs) != want.get(inputs):
        return f"the spec changed (generation {have.get(gen)} -> {want.get(gen)})"
    return None


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = (obj or {}).get(key) if isinstance(obj, dict) else None
    return obj


def keep_pinned(built: Obj, live: Obj | None) -> Obj:
    """What to apply for `built` given the `live` child: `built` itself (no live child, not a pinned
    kind, or `must_render`), else `built` with the live pod template (workloads: replicas, suspend and
    metadata still follow the spec) or the live data (the ConfigMap and the bus Secret)."""
    key = (built.get("apiVersion", ""), built.get("kind", ""))
    if live is None or key not in PINNED_PARTS or must_render(built, live) is not None:
        return built
    out = copy.deepcopy(built)
    if key == ("v1", "Secret"):  # the live values stand: base64 in `data` (what an API server keeps)
        out.pop("stringData", None)
        for field in ("data", "stringData"):
            if live.get(field):
                out[field] = copy.deepcopy(live[field])
        return with_spec_hash(out)
    part = PINNED_PARTS[key]
    kept = _get(live, part)
    if kept is None:
        return built
    parent = _get(out, part[:-1]) if len(part) > 1 else out
    parent[part[-1]] = copy.deepcopy(kept)
    return with_spec_hash(out)
