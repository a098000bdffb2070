"""core/v1 Toleration and Affinity as structural OpenAPI schemas for the CRD (instead of free-form).

The schemas are expanded from the Kubernetes OpenAPI that kubernetes-validate ships (`$ref`s inlined,
nullable types reduced, lists and maps bounded for the CEL cost estimator) and vendored next to this file as
core_v1_schemas.json, so `kuberl crd` needs no test dependency. Regenerate after a Kubernetes bump:
`python3 -m kuberl.api.core_schemas` (tests/unit/test_crd.py checks the vendored copy is current).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VENDORED = Path(__file__).with_name("core_v1_schemas.json")
KUBERNETES_VERSION = "v1.33.0"  # the API the schemas come from (the oldest minor KubeRL supports)
KINDS = {"Toleration": "toleration-v1.json", "Affinity": "affinity-v1.json"}
MAX_ITEMS = 64  # bound on every list and map (the CRD's CEL rules are costed against these)
_KEEP = {"description", "type", "enum", "format", "required", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
         "x-kubernetes-map-type", "x-kubernetes-int-or-string"}


def _structural(node: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """One schema node with its $ref inlined and only keys a structural CRD schema takes."""
    if "$ref" in node:
        node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**_structural(node["allOf"][0], defs), **{k: v for k, v in node.items() if k != "allOf"}}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            types = [t for t in (value if isinstance(value, list) else [value]) if t != "null"]
            out["type"] = types[0]
        elif key in _KEEP:
            out[key] = value
        elif key == "properties":
            out["properties"] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out["items"] = _structural(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict) and "properties" not in node:
            out["additionalProperties"] = _structural(value, defs)
    if out.get("type") == "array":
        out["maxItems"] = MAX_ITEMS
    if out.get("type") == "object" and "additionalProperties" in out:
        out["maxProperties"] = MAX_ITEMS
    if "enum" in out:
        out["enum"] = [v for v in out["enum"] if v is not None]
    return out


def expand_from_kubernetes_validate(version: str = KUBERNETES_VERSION) -> dict[str, Any]:
    """The schemas of KINDS from kubernetes-validate's copy of the Kubernetes OpenAPI (dev time only)."""
    import kubernetes_validate

    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"{version}-local"
    defs = json.loads((folder / "_definitions.json").read_text())["$defs"]
    return {kind: _structural(json.loads((folder / name).read_text()), defs) for kind, name in KINDS.items()}


def core_schema(kind: str) -> dict[str, Any]:
    """The vendored structural schema of a core/v1 kind in KINDS."""
    return json.loads(VENDORED.read_text())[kind]


if __name__ == "__main__":
    VENDORED.write_text(json.dumps(expand_from_kubernetes_validate(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {VENDORED} ({VENDORED.stat().st_size} bytes)")
