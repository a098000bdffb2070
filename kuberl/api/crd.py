"""The RLExperiment CustomResourceDefinition, generated from the pydantic models (`kuberl crd`).

`build_crd()` turns the models' JSON schema into a structural OpenAPI v3 schema as
apiextensions.k8s.io/v1 demands; `crds/kuberl.io_rlexperiments.yaml`, the Helm chart and
`kuberl validate` all use it. Never edit the YAML by hand: run `kuberl crd -o crds/`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from kuberl.api import v1alpha1 as api
from kuberl.api.core_schemas import core_schema

CRD_FILENAME = f"{api.GROUP}_{api.PLURAL}.yaml"
REGENERATE = "kuberl crd -o crds/"
HEADER = f"# Generated from kuberl/api/v1alpha1.py by `{REGENERATE}`. Do not edit.\n"

# Fields the `allocation` shorthand fills. They get no API-server default: a defaulted value would
# look explicit to the operator and contradict the shorthand (e.g. replicas 1 vs sglang:d4).
ALLOCATED_FIELDS = frozenset({
    "spec.rollout.engine", "spec.rollout.replicas", "spec.rollout.tensorParallelSize",
    "spec.rollout.pipelineParallelSize", "spec.rollout.accelerator.count",
    "spec.trainer.backend", "spec.trainer.nodes", "spec.trainer.accelerator.count",
    "spec.trainer.parallelism.data", "spec.trainer.parallelism.tensor", "spec.trainer.parallelism.pipeline",
    "spec.trainer.parallelism.context", "spec.trainer.parallelism.expert",
})

# JSON-schema keywords that pass through unchanged (all are legal in a structural schema).
_KEEP = {
    "type", "description", "enum", "minimum", "maximum", "pattern", "minLength", "maxLength",
    "minItems", "maxItems", "minProperties", "maxProperties", "format", "required", "default",
    "x-kubernetes-validations", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
}
# Keywords dropped on purpose: titles are noise; additionalProperties: false is the API server's
# pruning plus strict field validation, which a structural schema may not state.
_DROP = {"title"}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase."},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
     "description": "Why the experiment is (not) Ready: the Ready condition's reason (kubectl describe has the message)."},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.steps", "description": "Training steps done/planned."},
    {"name": "Version", "type": "integer", "jsonPath": ".status.progress.policyVersion", "description": "Policy version the engines serve."},
    {"name": "Reward", "type": "string", "jsonPath": ".status.progress.rewardText", "description": "Mean reward of the last step."},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.readyText", "description": "Ready/desired inference replicas."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # -o wide only (priority 1)
    {"name": "Samples/s", "type": "number", "jsonPath": ".status.progress.samplesPerSecond", "priority": 1,
     "description": "Trajectories per second the trainer consumes."},
    {"name": "Staleness", "type": "number", "jsonPath": ".status.progress.stalenessMean", "priority": 1,
     "description": "Mean policy-version lag of the trained samples."},
    {"name": "Trainer", "type": "string", "jsonPath": ".status.trainer.readyText", "priority": 1, "description": "Ready/desired trainer pods."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1, "description": "Trainer restarts."},
]


def _model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model class reachable from `root`, by class name (the $defs keys)."""
    found: dict[str, type[BaseModel]] = {}
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        for field in cls.model_fields.values():
            stack = [field.annotation]
            while stack:
                t = stack.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    todo.append(t)
                stack.extend(getattr(t, "__args__", ()))
    return found


def _factory_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """camelCase field -> the JSON value of its default_factory (pydantic leaves these out of the schema).

    Models are dumped with exclude_unset so that only what the factory sets explicitly becomes a
    default; the nested fields' own defaults then apply, as the API server defaults recursively.
    """
    out = {}
    for name, field in cls.model_fields.items():
        if field.default_factory is None:
            continue
        value = field.default_factory()
        if isinstance(value, BaseModel):
            value = value.model_dump(by_alias=True, exclude_unset=True, mode="json")
        out[field.alias or name] = value
    return out


class _Converter:
    """Inline $refs and rewrite JSON Schema 2020-12 (pydantic) into structural OpenAPI v3.0."""

    def __init__(self, root: type[BaseModel]) -> None:
        schema = root.model_json_schema(by_alias=True, mode="validation")
        self.defs: dict[str, Any] = schema.pop("$defs", {})
        self.defs[root.__name__] = schema
        self.classes = _model_classes(root)

    def model(self, name: str, path: str, defaults: bool) -> dict[str, Any]:
        return self.node(self.defs[name], path, defaults, def_name=name)

    def node(self, src: dict[str, Any], path: str, defaults: bool, def_name: str | None = None) -> dict[str, Any]:
        src = dict(src)
        if "$ref" in src:  # siblings of a $ref (description, default) win over the referenced schema
            ref = src.pop("$ref").rsplit("/", 1)[-1]
            merged = {k: v for k, v in self.defs[ref].items() if k not in src} | src
            return self.node(merged, path, defaults, def_name=ref)
        if "anyOf" in src:
            return self._any_of(src, path, defaults)
        if "const" in src:
            src["enum"] = [src.pop("const")]
        out: dict[str, Any] = {}
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in src:  # 2020-12 number -> OpenAPI 3.0 bound + boolean flag
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = src.pop(key)
                out[key] = True
        extra_props = src.pop("additionalProperties", None)
        props = src.pop("properties", None)
        items = src.pop("items", None)
        for key, value in src.items():
            if key in _DROP:
                continue
            if key not in _KEEP:
                raise ValueError(f"{path}: JSON-schema keyword {key!r} has no structural equivalent; extend kuberl/api/crd.py")
            out[key] = copy.deepcopy(value)
        if not defaults or path in ALLOCATED_FIELDS or out.get("default", 0) is None:
            out.pop("default", None)
        if props is not None:
            factory = _factory_defaults(self.classes[def_name]) if def_name in self.classes else {}
            out["properties"] = {}
            for key, prop in props.items():
                child = self.node(prop, f"{path}.{key}", defaults)
                if defaults and key in factory and f"{path}.{key}" not in ALLOCATED_FIELDS:
                    child["default"] = factory[key]
                out["properties"][key] = child
        if isinstance(extra_props, dict):
            if extra_props:
                out["additionalProperties"] = self.node(extra_props, f"{path}.*", defaults)
            else:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif extra_props is True:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if items is not None:
            out["items"] = self.node(items, f"{path}[*]", defaults)
        if "required" in out and not out["required"]:
            del out["required"]
        return out

    def _any_of(self, src: dict[str, Any], path: str, defaults: bool) -> dict[str, Any]:
        branches = [b for b in src.pop("anyOf") if b.get("type") != "null"]
        if src.get("x-kubernetes-int-or-string"):
            # The one anyOf a structural schema allows: exactly [integer, string], nothing else inside.
            out = {k: v for k, v in src.items() if k not in _DROP}
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if not defaults:
                out.pop("default", None)
            return out
        if len(branches) == 1:  # Optional[X]: the field is optional, never nullable
            inner = dict(branches[0])
            inner.update({k: v for k, v in src.items() if k != "default" or v is not None})
            return self.node(inner, path, defaults)
        if all(b.get("x-kubernetes-int-or-string") for b in branches):
            return self.node({**branches[0], **src}, path, defaults)
        raise ValueError(f"{path}: a union of {len(branches)} types is not structural; use one type or int-or-string")


_ORDER = [
    "type", "description", "required", "enum", "default", "format", "minimum", "exclusiveMinimum", "maximum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties", "maxProperties",
    "anyOf", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "x-kubernetes-validations", "items", "additionalProperties", "properties",
]


def _ordered(schema: dict[str, Any]) -> dict[str, Any]:
    """Keys in one fixed order (type and description first, nested schemas last), so diffs stay readable."""
    out = {k: schema[k] for k in sorted(schema, key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER))}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _ordered(v) for k, v in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _ordered(out[key])
    if "x-kubernetes-validations" in out:
        out["x-kubernetes-validations"] = [
            {k: r[k] for k in ("rule", "message", "fieldPath", "reason") if k in r} for r in out["x-kubernetes-validations"]
        ]
    return out


def _strip_defaults(schema: dict[str, Any]) -> None:
    schema.pop("default", None)
    for child in (schema.get("properties") or {}).values():
        _strip_defaults(child)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _strip_defaults(schema[key])


# core/v1 Toleration fields the API server checks on pods: checked here at admission already.
TOLERATION_ENUMS = {"operator": ["Equal", "Exists"], "effect": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]}


def _core_scheduling_schemas(spec: dict[str, Any]) -> None:
    """tolerations and affinity of the rollout and trainer get the real core/v1 schemas (a typo is
    rejected at admission instead of reaching the pods, or a 422 on the child, as free-form did)."""
    toleration = core_schema("Toleration")
    for key, values in TOLERATION_ENUMS.items():
        toleration["properties"][key]["enum"] = values
    for role in ("rollout", "trainer"):
        props = spec["properties"][role]["properties"]
        for key, schema in (("tolerations", {"items": toleration}), ("affinity", core_schema("Affinity"))):
            kept = {k: v for k, v in props[key].items() if k in ("description", "maxItems", "type", "default")}  # ours win
            props[key] = {**copy.deepcopy(schema), **kept}
            props[key].pop("x-kubernetes-preserve-unknown-fields", None)
            if key == "tolerations":
                props[key]["type"] = "array"


def build_schema() -> dict[str, Any]:
    """The openAPIV3Schema of RLExperiment (structural, $refs inlined)."""
    conv = _Converter(api.RLExperiment)
    spec = conv.model("RLExperimentSpec", "spec", defaults=True)
    # Status is written by the operator only; API-server defaults there would invent a phase.
    status = conv.model("RLExperimentStatus", "status", defaults=False)
    _strip_defaults(status)
    status["properties"]["conditions"].update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    _core_scheduling_schemas(spec)
    meta_name = api.ObjectMeta.model_fields["name"].metadata
    name_schema: dict[str, Any] = {"type": "string"}
    for m in meta_name:
        if hasattr(m, "max_length"):
            name_schema["maxLength"] = m.max_length
        if hasattr(m, "pattern"):
            name_schema["pattern"] = m.pattern
    return _ordered({
        "type": "object",
        "description": (api.RLExperiment.__doc__ or "").strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object: kuberl.io/v1alpha1."},
            "kind": {"type": "string", "description": "Kind of this object: RLExperiment."},
            # Only name restrictions are allowed under metadata; 52 leaves room for child names.
            "metadata": {"type": "object", "properties": {"name": name_schema}},
            "spec": spec,
            "status": status,
        },
    })


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) of RLExperiment, as a plain dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}", "labels": {"app.kubernetes.io/part-of": "kuberl"}},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": build_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.rollout.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def render_crd() -> str:
    """The CRD as the YAML text committed under crds/."""
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=120, allow_unicode=True)


def _target(output: str) -> Path:
    path = Path(output)
    return path / CRD_FILENAME if output.endswith("/") or path.is_dir() else path


def main(args: argparse.Namespace) -> int:
    """`kuberl crd [-o PATH] [--check]`."""
    text = render_crd()
    if args.output is None:
        if args.check:
            print("kuberl crd: --check needs -o PATH (the file or folder to compare with)", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        return 0
    path = _target(args.output)
    if args.check:
        if not path.exists():
            print(f"{path}: missing; generate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        if path.read_text() != text:
            print(f"{path}: out of date with kuberl/api/v1alpha1.py; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path}: up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
