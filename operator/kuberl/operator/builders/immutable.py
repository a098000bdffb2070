"""Fields the API server refuses to change after creation, kept from the live object before an apply.

Called by the kopf handlers (O2) between reading a child and applying the rebuilt one: a spec edit
that would touch such a field (bus.embedded.storage -> volumeClaimTemplates, weightSync.mode ->
the checkpoint PVC's accessModes, a smaller checkpoint.size) is reported instead of failing the
whole apply with 422. The trainer Job's template is immutable too, but the handlers re-create Jobs.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kuberl.operator.builders.common import Obj

# (apiVersion, kind) -> paths under the object that cannot change once created.
IMMUTABLE_FIELDS: dict[tuple[str, str], tuple[tuple[str, ...], ...]] = {
    ("apps/v1", "StatefulSet"): (
        ("spec", "selector"),
        ("spec", "serviceName"),
        ("spec", "podManagementPolicy"),
        ("spec", "volumeClaimTemplates"),
    ),
    ("apps/v1", "Deployment"): (("spec", "selector"),),
    ("v1", "PersistentVolumeClaim"): (
        ("spec", "accessModes"),
        ("spec", "storageClassName"),
        ("spec", "volumeMode"),
    ),
}


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _covered(wanted: Any, live: Any) -> bool:
    """Whether `live` already says everything `wanted` says (the server adds defaults and status)."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(k in live and _covered(v, live[k]) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(wanted) == len(live) and all(_covered(w, x) for w, x in zip(wanted, live, strict=True))
    return wanted == live or str(wanted) == str(live)


def keep_immutable_fields(built: Obj, live: Obj | None) -> tuple[Obj, list[str]]:
    """`built` with its immutable fields taken from `live`, and one message per field that differed.

    A PVC's storage request may grow (when its StorageClass allows expansion) but never shrink: a
    smaller request keeps the live size. Without a live object, `built` is returned unchanged.
    """
    if live is None:
        return built, []
    out = copy.deepcopy(built)
    name = f"{built['kind']}/{built['metadata']['name']}"
    notes = []
    for path in IMMUTABLE_FIELDS.get((built.get("apiVersion", ""), built.get("kind", "")), ()):
        wanted, current = _get(out, path), _get(live, path)
        if current is None or _covered(wanted, current):
            continue
        parent = _get(out, path[:-1])
        if isinstance(parent, dict):
            parent[path[-1]] = copy.deepcopy(current)
        if wanted is None:
            continue  # left to the API server, which filled it (PVC volumeMode, the default StorageClass): no change
        notes.append(f"{name}: {'.'.join(path)} cannot change after creation; keeping {current!r} instead of {wanted!r}")
    if built.get("kind") == "PersistentVolumeClaim":
        size_path = ("spec", "resources", "requests", "storage")
        wanted, current = _get(out, size_path), _get(live, size_path)
        if wanted is not None and current is not None and parse_quantity(wanted) < parse_quantity(current):
            out["spec"]["resources"]["requests"]["storage"] = current
            notes.append(f"{name}: a PersistentVolumeClaim cannot shrink; keeping {current} instead of {wanted}")
    return out, notes
