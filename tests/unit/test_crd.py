"""The generated CRD: current on disk, structural as the API server defines it, CEL rules that compile and bite."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kuberl.api import crd as crd_mod
from kuberl.api.crd import ALLOCATED_FIELDS, CRD_FILENAME, build_crd, render_crd
from kuberl.api.validation import (
    compile_rule,
    evaluate_rule,
    iter_rules,
    prune_and_default,
    schema_error,
)

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / CRD_FILENAME

# ---------------------------------------------------------------------------------------------
# A structural-schema checker, after k8s.io/apiextensions-apiserver:
#   pkg/apiserver/schema/validation.go (ValidateStructural) and
#   pkg/apis/apiextensions/validation/validation.go (ValidateCustomResourceDefinitionOpenAPISchema).
# ---------------------------------------------------------------------------------------------

# JSONSchemaProps fields of apiextensions.k8s.io/v1 (anything else is not even decodable).
JSON_SCHEMA_PROPS = {
    "id", "$schema", "$ref", "description", "type", "format", "title", "default", "maximum", "exclusiveMaximum",
    "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems",
    "multipleOf", "enum", "maxProperties", "minProperties", "required", "items", "allOf", "oneOf", "anyOf", "not",
    "properties", "additionalProperties", "patternProperties", "dependencies", "additionalItems", "definitions",
    "externalDocs", "example", "nullable", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
    "x-kubernetes-int-or-string", "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type",
    "x-kubernetes-validations",
}
FORBIDDEN = {  # keyword -> the API server's message
    "$ref": "$ref is not supported", "id": "id is not supported", "$schema": "$schema is not supported",
    "definitions": "definitions is not supported", "dependencies": "dependencies is not supported",
    "patternProperties": "patternProperties is not supported", "additionalItems": "additionalItems is not supported",
}
OPENAPI_TYPES = {"array", "boolean", "integer", "number", "object", "string"}
# Inside anyOf/allOf/oneOf/not ("value validation") these must be absent to be structural.
FORBIDDEN_IN_JUNCTORS = {
    "type", "default", "title", "description", "nullable", "externalDocs", "additionalProperties",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string",
    "x-kubernetes-list-map-keys", "x-kubernetes-list-type", "x-kubernetes-map-type", "x-kubernetes-validations",
}
ROOT_ALLOWED = {"description", "type", "format", "title", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
                "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "multipleOf", "required",
                "items", "properties", "externalDocs", "example", "x-kubernetes-preserve-unknown-fields",
                "x-kubernetes-validations"}
INT_OR_STRING_ANYOF = [{"type": "integer"}, {"type": "string"}]


def structural_problems(schema: dict[str, Any], path: str = "openAPIV3Schema", level: str = "root",
                        in_meta: bool = False) -> list[str]:
    """Every way `schema` breaks the apiextensions/v1 structural rules (empty = structural)."""
    return [*_keyword_problems(schema, path, level), *_type_problems(schema, path, level),
            *_nested_problems(schema, path, level, in_meta), *_junctor_node_problems(schema, path),
            *_extension_problems(schema, path, in_meta)]


def _keyword_problems(schema: dict[str, Any], path: str, level: str) -> list[str]:
    """Keywords JSONSchemaProps lacks or forbids, and what the root with the status subresource may hold."""
    p: list[str] = []
    for key in schema:
        if key not in JSON_SCHEMA_PROPS:
            p.append(f"{path}: {key!r} is not a JSONSchemaProps field")
        if key in FORBIDDEN:
            p.append(f"{path}.{key}: {FORBIDDEN[key]}")
    if level == "root":
        p += [f"{path}.{k}: not allowed at the root with the status subresource" for k in schema if k not in ROOT_ALLOWED]
        if schema.get("type") != "object":
            p.append(f"{path}.type: must be object at the root")
        if "additionalProperties" in schema:
            p.append(f"{path}.additionalProperties: must not be used at the root")
    return p


def _type_problems(schema: dict[str, Any], path: str, level: str) -> list[str]:
    """type, x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, uniqueItems."""
    p: list[str] = []
    t = schema.get("type")
    if t is not None and t not in OPENAPI_TYPES:
        p.append(f"{path}.type: unsupported value {t!r}")
    int_or_string = schema.get("x-kubernetes-int-or-string", False)
    preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
    if not t and not int_or_string and not preserve:
        p.append(f"{path}.type: must not be empty for specified {'array items' if level == 'item' else 'object fields'}")
    if int_or_string and t:
        p.append(f"{path}.type: must be empty with x-kubernetes-int-or-string")
    if int_or_string and preserve:
        p.append(f"{path}.x-kubernetes-preserve-unknown-fields: must be false if x-kubernetes-int-or-string is true")
    if preserve is False and "x-kubernetes-preserve-unknown-fields" in schema:
        p.append(f"{path}.x-kubernetes-preserve-unknown-fields: must be true or undefined")
    if schema.get("uniqueItems"):
        p.append(f"{path}.uniqueItems: cannot be set to true since the runtime complexity becomes quadratic")
    return p


def _nested_problems(schema: dict[str, Any], path: str, level: str, in_meta: bool) -> list[str]:
    """additionalProperties, exclusive bounds, items and properties, recursing into the nested schemas."""
    p: list[str] = []
    t = schema.get("type")
    if "additionalProperties" in schema:
        ap = schema["additionalProperties"]
        if schema.get("properties"):
            p.append(f"{path}.additionalProperties: additionalProperties and properties are mutual exclusive")
        if ap is False:
            p.append(f"{path}.additionalProperties: false is not structural (unknown fields are pruned instead)")
        if isinstance(ap, dict):
            p += structural_problems(ap, f"{path}.additionalProperties", "field", in_meta)
    for ek in ("exclusiveMinimum", "exclusiveMaximum"):
        if ek in schema and not isinstance(schema[ek], bool):
            p.append(f"{path}.{ek}: must be a boolean in OpenAPI v3.0 (the bound goes in minimum/maximum)")
        if schema.get(ek) is True and ("minimum" if ek == "exclusiveMinimum" else "maximum") not in schema:
            p.append(f"{path}.{ek}: needs the bound it qualifies")
    if t == "array":
        if not isinstance(schema.get("items"), dict):
            p.append(f"{path}.items: must be specified (one schema object, not an array)")
        else:
            p += structural_problems(schema["items"], f"{path}.items", "item", in_meta)
    if "items" in schema and t != "array":
        p.append(f"{path}.items: on a node of type {t!r}")
    if "properties" in schema and t not in ("object", None):
        p.append(f"{path}.properties: on a node of type {t!r}")
    for key, sub in (schema.get("properties") or {}).items():
        sub_path = f"{path}.properties[{key}]"
        if level == "root" and key == "metadata":
            p += _metadata_problems(sub, sub_path)
            continue
        if level == "root" and key in ("apiVersion", "kind") and sub.get("type") != "string":
            p.append(f"{sub_path}.type: must be string")
        p += structural_problems(sub, sub_path, "field", in_meta)
    return p


def _junctor_node_problems(schema: dict[str, Any], path: str) -> list[str]:
    """anyOf/allOf/oneOf/not branches (the one permitted int-or-string anyOf aside) and nullable."""
    p: list[str] = []
    int_or_string = schema.get("x-kubernetes-int-or-string", False)
    for junctor in ("anyOf", "allOf", "oneOf"):
        for i, branch in enumerate(schema.get(junctor) or []):
            if junctor == "anyOf" and int_or_string and schema["anyOf"] == INT_OR_STRING_ANYOF:
                break  # the one permitted shape
            p += _junctor_problems(branch, f"{path}.{junctor}[{i}]", schema)
    if "not" in schema:
        p += _junctor_problems(schema["not"], f"{path}.not", schema)
    if schema.get("nullable"):
        p.append(f"{path}.nullable: the generator promises optional, never nullable, fields")
    return p


def _extension_problems(schema: dict[str, Any], path: str, in_meta: bool) -> list[str]:
    """x-kubernetes-list-map-keys, x-kubernetes-validations and defaults."""
    p: list[str] = []
    if schema.get("x-kubernetes-list-type") == "map":
        item = schema.get("items") or {}
        for key in schema.get("x-kubernetes-list-map-keys") or []:
            prop = (item.get("properties") or {}).get(key)
            if prop is None or prop.get("type") in ("object", "array"):
                p.append(f"{path}.x-kubernetes-list-map-keys: {key!r} must be a scalar item property")
            elif key not in item.get("required", []) and "default" not in prop:
                p.append(f"{path}.x-kubernetes-list-map-keys: {key!r} must have a default or be required")
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        if not str(rule.get("rule", "")).strip():
            p.append(f"{path}.x-kubernetes-validations[{i}].rule: rule is not specified")
        if "\n" in str(rule.get("message", "")):
            p.append(f"{path}.x-kubernetes-validations[{i}].message: must not contain line breaks")
        if "fieldPath" in rule and resolve(schema, rule["fieldPath"]) is None:
            p.append(f"{path}.x-kubernetes-validations[{i}].fieldPath: must be a valid path")
    if "default" in schema:
        if in_meta:
            p.append(f"{path}.default: must not be set in metadata")
        p += [f"{path}.default: {msg}" for msg in default_problems(schema, schema["default"])]
    return p


def _metadata_problems(meta: dict[str, Any], path: str) -> list[str]:
    """metadata at the root may only be `type: object` plus restrictions on name and generateName."""
    rest = {k: v for k, v in meta.items() if k not in ("type", "properties")}
    props = meta.get("properties") or {}
    bad = [k for k in props if k not in ("name", "generateName")]
    p = [f"{path}: must not specify anything other than name and generateName" for _ in ([1] if rest or bad else [])]
    if meta.get("type") != "object":
        p.append(f"{path}.type: must be object")
    for key, sub in props.items():
        p += [f"{path}.properties[{key}]: {k} is not a value restriction" for k in sub if k in ("default", "description", "properties")]
    return p


def _junctor_problems(branch: dict[str, Any], path: str, outer: dict[str, Any]) -> list[str]:
    p = [f"{path}.{k}: must be empty to be structural" for k in branch if k in FORBIDDEN_IN_JUNCTORS]
    for key, sub in (branch.get("properties") or {}).items():
        if key not in (outer.get("properties") or {}):
            p.append(f"{path}.properties[{key}]: must be specified outside the logical junctor too")
        p += _junctor_problems(sub, f"{path}.properties[{key}]", (outer.get("properties") or {}).get(key, {}))
    if "metadata" in (branch.get("properties") or {}):
        p.append(f"{path}.properties[metadata]: must not be specified in a nested context")
    return p


def resolve(schema: dict[str, Any], field_path: str) -> dict[str, Any] | None:
    """The sub-schema a CEL fieldPath like `.rollout.accelerator.count` points at (None = invalid)."""
    node = schema
    for part in field_path.lstrip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    return node


def default_problems(schema: dict[str, Any], default: Any) -> list[str]:
    """A default must survive pruning unchanged and validate against its own node (after nested defaulting)."""
    errors: list = []
    pruned = prune_and_default(schema, copy.deepcopy(default), "default", errors)
    p = [str(e) for e in errors]
    for err in jsonschema.Draft4Validator(schema).iter_errors(pruned):
        p.append(str(schema_error(err)))
    return p


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return build_crd()


@pytest.fixture(scope="module")
def schema(crd) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_is_what_the_models_generate():
    assert COMMITTED.exists(), f"{COMMITTED} is missing: run `{crd_mod.REGENERATE}`"
    assert COMMITTED.read_text() == render_crd(), (
        f"{COMMITTED.relative_to(ROOT)} is out of date with kuberl/api/v1alpha1.py: run `{crd_mod.REGENERATE}`"
    )


def test_crd_check_flag_reports_a_stale_file(tmp_path, capsys):
    target = tmp_path / CRD_FILENAME
    assert crd_mod.main(argparse.Namespace(output=str(tmp_path) + "/", check=False)) == 0
    assert crd_mod.main(argparse.Namespace(output=str(target), check=True)) == 0
    target.write_text(target.read_text().replace("rlx", "rlz"))
    assert crd_mod.main(argparse.Namespace(output=str(target), check=True)) == 1
    assert "kuberl crd -o crds/" in capsys.readouterr().err


def test_crd_names_versions_and_subresources(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "rlexperiments.kuberl.io"
    assert spec["group"] == "kuberl.io" and spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "RLExperiment", "listKind": "RLExperimentList", "plural": "rlexperiments",
        "singular": "rlexperiment", "shortNames": ["rlx"], "categories": ["kuberl"],
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {"specReplicasPath": ".spec.rollout.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"},
    }


def test_crd_is_a_valid_customresourcedefinition_object(crd):
    kubernetes_validate.validate(crd, "1.32", strict=True)  # raises on any unknown or mistyped field


def test_schema_is_structural(schema):
    assert structural_problems(schema) == []


@pytest.mark.parametrize(
    "broken, expected",
    [
        ({"type": "object", "properties": {"spec": {"$ref": "#/definitions/Spec"}}}, "$ref is not supported"),
        ({"type": "object", "properties": {"spec": {"description": "no type"}}}, "must not be empty for specified object fields"),
        ({"type": "object", "properties": {"spec": {"type": "object", "properties": {"a": {"type": "string"}},
                                                    "additionalProperties": False}}}, "mutual exclusive"),
        ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}, "must be empty to be structural"),
        ({"type": "object", "properties": {"metadata": {"type": "object", "properties": {"labels": {"type": "object"}}}}},
         "must not specify anything other than name and generateName"),
        ({"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0}}}, "must be a boolean"),
        ({"type": "object", "properties": {"l": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}, "quadratic"),
        ({"type": "object", "properties": {"n": {"type": "integer", "default": "two"}}}, "must be of type integer"),
        ({"type": "object", "properties": {"o": {"type": "object", "properties": {"a": {"type": "string"}}, "default": {"b": 1}}}},
         'unknown field "default.b"'),
        ({"type": "object", "x-kubernetes-validations": [{"rule": "true", "fieldPath": ".nope"}]}, "fieldPath: must be a valid path"),
    ],
    ids=["ref", "untyped-field", "additionalProperties-false-with-properties", "nullable-anyOf", "metadata-over-specified",
         "2020-12-exclusiveMinimum", "uniqueItems", "mistyped-default", "unpruned-default", "bad-fieldPath"],
)
def test_structural_checker_catches_what_the_api_server_rejects(broken, expected):
    problems = structural_problems(broken)
    assert any(expected in p for p in problems), problems


def test_quantities_are_int_or_string_with_the_kubernetes_pattern(schema):
    storage = schema["properties"]["spec"]["properties"]["bus"]["properties"]["embedded"]["properties"]["storage"]
    assert storage["x-kubernetes-int-or-string"] is True
    assert storage["anyOf"] == INT_OR_STRING_ANYOF and "type" not in storage
    assert re.match(storage["pattern"], "10Gi") and not re.match(storage["pattern"], "10 GB")


def test_tolerations_and_affinity_have_the_core_v1_schemas(schema):
    # B8: free-form, a typo reached the pods (or a 422 on the child); now admission names it.
    from kuberl.api.core_schemas import KUBERNETES_VERSION, core_schema, expand_from_kubernetes_validate

    assert expand_from_kubernetes_validate(KUBERNETES_VERSION) == {k: core_schema(k) for k in ("Toleration", "Affinity")}, \
        "core_v1_schemas.json is stale: python3 -m kuberl.api.core_schemas"
    for role in ("rollout", "trainer"):
        props = schema["properties"]["spec"]["properties"][role]["properties"]
        tol = props["tolerations"]["items"]
        assert "x-kubernetes-preserve-unknown-fields" not in tol and set(tol["properties"]) == {"key", "operator", "value", "effect", "tolerationSeconds"}
        assert tol["properties"]["effect"]["enum"] == ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]
        aff = props["affinity"]
        assert "x-kubernetes-preserve-unknown-fields" not in aff
        term = aff["properties"]["nodeAffinity"]["properties"]["requiredDuringSchedulingIgnoredDuringExecution"]["properties"]["nodeSelectorTerms"]["items"]
        assert term["properties"]["matchExpressions"]["items"]["required"] == ["key", "operator"]
    good = {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    rollout = schema["properties"]["spec"]["properties"]["rollout"]
    jsonschema.validate(good, {"type": "object", "properties": {"tolerations": rollout["properties"]["tolerations"]}})
    with pytest.raises(jsonschema.ValidationError, match="NoSchedul"):
        jsonschema.validate({"tolerations": [{"key": "k", "effect": "NoSchedul"}]},
                            {"type": "object", "properties": {"tolerations": rollout["properties"]["tolerations"]}})


def test_field_descriptions_reach_the_schema_for_kubectl_explain(schema):
    algo = schema["properties"]["spec"]["properties"]["algorithm"]["properties"]
    assert "group size" in algo["samplesPerPrompt"]["description"]
    undocumented = []

    def walk(node, path):
        for key, sub in (node.get("properties") or {}).items():
            if not sub.get("description") and path != "openAPIV3Schema.metadata":
                undocumented.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")

    walk(schema["properties"]["spec"], "spec")
    assert undocumented == []


def test_allocated_fields_get_no_api_server_default(schema):
    for dotted in ALLOCATED_FIELDS:
        node = resolve(schema, "." + dotted)
        assert node is not None, dotted
        assert "default" not in node, f"{dotted} must stay unset so that `allocation` can fill it"


def test_status_has_no_defaults_and_conditions_are_a_map_list(schema):
    status = schema["properties"]["status"]
    assert "default" not in yaml.safe_dump(status)
    assert status["properties"]["conditions"]["x-kubernetes-list-type"] == "map"


def test_printer_columns_read_fields_that_exist(crd, schema):
    cols = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(cols) == ["Phase", "Reason", "Step", "Version", "Reward", "Rollout", "Age", "Samples/s", "Staleness", "Trainer", "Restarts"]
    wide = {c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if c.get("priority") == 1}
    assert wide == {"Samples/s", "Staleness", "Trainer", "Restarts"}, "kubectl get -o wide only"
    for name, path in cols.items():
        if "[?(" in path:  # .status.conditions[?(@.type=="Ready")].reason: the list, then the item's field
            head, tail = path.split("[", 1)
            items = (resolve(schema, head) or {}).get("items") or {}
            assert tail.split("].", 1)[1] in (items.get("properties") or {}), f"printer column {name}: {path} is not in the schema"
        elif path != ".metadata.creationTimestamp":
            assert resolve(schema, path) is not None, f"printer column {name}: {path} is not in the schema"
    for key in ("statusReplicasPath", "labelSelectorPath"):
        assert resolve(schema, crd["spec"]["versions"][0]["subresources"]["scale"][key]) is not None


def test_lists_and_maps_are_bounded_for_the_cel_cost_estimator(schema):
    unbounded = []

    def walk(node, path):
        if node.get("type") == "array" and "maxItems" not in node:
            unbounded.append(path)
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
            unbounded.append(path)
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")

    walk(schema["properties"]["spec"], "spec")
    assert unbounded == []


# ---------------------------------------------------------------------------------------------
# CEL
# ---------------------------------------------------------------------------------------------

SELF_PATH = re.compile(r"\bself((?:\.[A-Za-z_]\w*)+)")
# `self.volumes.all(v, ... v.name ...)`: the macro's variable is an item of the list (or a key of a map).
MACRO = re.compile(r"\bself((?:\.[A-Za-z_]\w*)+)\.(?:all|exists|exists_one|map|filter)\(\s*([A-Za-z_]\w*)\s*,")


def macro_variable_fields(rule: str) -> list[tuple[str, str]]:
    """(list path, field) for each `var.field` that a macro over `self.<list path>` reads."""
    out = []
    for match in MACRO.finditer(rule):
        var = match.group(2)
        # `m.endsWith(...)` is a method of a string item, not a field
        out += [(match.group(1), field) for field in re.findall(rf"\b{var}\.([A-Za-z_]\w*)(?!\w|\()", rule[match.end():])]
    return out


def test_every_cel_rule_compiles_and_names_only_declared_fields(schema):
    rules = list(iter_rules(schema))
    assert len(rules) >= 12
    for where, rule in rules:
        compile_rule(rule["rule"])  # raises celpy.CELParseError on bad syntax
        node = schema
        for part in [p for p in where.split(".") if p]:
            name, items = part.removesuffix("[*]"), part.endswith("[*]")  # a rule on a list's items (podTemplate.sidecars[*])
            node = node["properties"][name]["items"] if items else node["properties"][name]
        for match in SELF_PATH.finditer(rule["rule"]):
            # the API server type-checks rules against the schema: an undeclared field does not compile
            path = match.group(1)
            if rule["rule"][match.end():match.end() + 1] == "(":  # self.labels.all(...): a macro on a field
                path = path.rpartition(".")[0]
            if not path:
                continue
            assert resolve(node, path) is not None, f"{where}: {rule['rule']!r} names undeclared {path}"
        for path, field in macro_variable_fields(rule["rule"]):
            # the API server builds an item's type from its declared properties only (preserve-unknown-fields adds none)
            items = (resolve(node, path) or {}).get("items") or {}
            assert field in (items.get("properties") or {}), f"{where}: {rule['rule']!r} reads {field} of {path}'s items, undeclared"
        assert rule["message"] and "\n" not in rule["message"]


def test_a_macro_variable_reading_an_undeclared_item_field_is_caught():
    assert macro_variable_fields("!has(self.volumes) || self.volumes.all(v, !(v.name in ['x']))") == [(".volumes", "name")]
    assert macro_variable_fields("self.env.all(e, !e.name.startsWith('K'))") == [(".env", "name")]
    assert macro_variable_fields("self.targetModules.exists(m, m.endsWith('lm_head'))") == []


def test_a_syntax_error_in_a_rule_is_caught():
    with pytest.raises(celpy.CELParseError):
        compile_rule("self.a ==")


_SOURCES = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "add-small"}}


@pytest.mark.parametrize("where, value, ok", [
    ("spec.model", {"id": "Qwen/Qwen2.5-1.5B-Instruct"}, True),
    ("spec.model", {"id": "a", "builtin": "tiny-qwen2"}, False),
    ("spec.model", {}, False),
    ("spec.algorithm", {"name": "dapo", "samplesPerPrompt": 8, "epsClip": 0.2, "epsClipHigh": 0.28}, True),
    ("spec.algorithm", {"name": "dapo", "samplesPerPrompt": 8, "epsClip": 0.2, "epsClipHigh": 0.1}, False),
    ("spec.algorithm", {"name": "grpo", "samplesPerPrompt": 1, "epsClip": 0.2}, False),
    ("spec.algorithm", {"name": "reinforce++", "samplesPerPrompt": 1, "epsClip": 0.2}, True),
    ("spec.rollout.autoscaling", {"enabled": True, "minReplicas": 4, "maxReplicas": 2, "cooldownSeconds": 1}, False),
    ("spec.bus", {"embedded": {}, "external": {"url": "nats://x:4222"}}, False),
    # the allocation shorthand read at admission (issue #36): fields it fills must agree, its dims must make sense
    ("spec", {**_SOURCES, "allocation": "vllm:d2t2+megatron:d2p2t2"}, True),
    ("spec", {**_SOURCES, "allocation": "sglang:d4+fsdp:d4", "rollout": {"engine": "sglang", "tensorParallelSize": 1},
              "trainer": {"backend": "fsdp", "nodes": 1}}, True),
    ("spec", {**_SOURCES, "allocation": "sglang:d4+fsdp:d4", "rollout": {"engine": "vllm"}}, False),
    ("spec", {**_SOURCES, "allocation": "sglang:d4+fsdp:d4", "trainer": {"backend": "megatron"}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d2t2+fsdp:d4", "rollout": {"tensorParallelSize": 1}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d2p2+fsdp:d4", "rollout": {"pipelineParallelSize": 1}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d2t2+fsdp:d4", "rollout": {"accelerator": {"count": 1}}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+megatron:d2t2p2", "trainer": {"parallelism": {"data": 2, "tensor": 2, "pipeline": 2}}}, True),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+megatron:d2t2p2", "trainer": {"parallelism": {"data": 4}}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+megatron:d2t2p2", "trainer": {"parallelism": {"pipeline": 1}}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d16", "trainer": {"nodes": 2}}, True),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d16", "trainer": {"nodes": 1}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d12"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d8", "trainer": {"accelerator": {"count": 3}}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1d2+fsdp:d4"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+megatron:p2d2p2"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d2t2"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+fsdp:d0"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d1+megatron:d6e4"}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d4+fsdp:d4", "rollout": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}}}, False),
    ("spec", {**_SOURCES, "allocation": "vllm:d4+fsdp:d4",
              "rollout": {"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}}}, True),
])
def test_cel_rules_evaluate_on_valid_and_invalid_objects(schema, where, value, ok):
    node = schema
    for part in where.split("."):
        node = node["properties"][part]
    value = prune_and_default(node, value, where, [])
    results = [evaluate_rule(r["rule"], node, value) for r in node["x-kubernetes-validations"]]
    assert all(results) is ok, results


def test_cel_sees_numbers_as_doubles_even_when_written_as_integers(schema):
    algo = schema["properties"]["spec"]["properties"]["algorithm"]
    value = prune_and_default(algo, {"epsClip": 1, "epsClipHigh": 2}, "spec.algorithm", [])
    # int vs double has no overload in CEL: the schema's `number` type must make both doubles
    assert all(evaluate_rule(r["rule"], algo, value) for r in algo["x-kubernetes-validations"])
