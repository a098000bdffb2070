"""`kuberl validate`: check RLExperiment manifests exactly as admission would, without a cluster.

The same steps as the API server, in its order and wording: strict unknown-field detection and
null pruning, structural defaulting, the CRD's openAPIV3Schema (jsonschema), every CEL rule of the
CRD (cel-python), then the pydantic models' own checks (what the operator would reject). Called by
`kuberl validate FILE...` and by tests; `validate_manifest(doc)` is pure.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
import pydantic
from celpy import celtypes

from kuberl.api.crd import build_schema
from kuberl.api.loading import load_documents
from kuberl.api.v1alpha1 import API_VERSION, KIND, FieldError, RLExperiment

_MISSING = object()


@dataclass(frozen=True)
class ValidationError:
    """One problem: where (`spec.rollout.replicas`), what value, and why; printed as the API server would."""

    path: str
    value: Any
    message: str
    kind: str = "Invalid value"  # the field.ErrorType: Invalid value, Unsupported value, Required value, ...

    def __str__(self) -> str:
        if self.kind == "unknown field":
            return f'unknown field "{self.path}"'
        if self.kind == "Required value":
            return f"{self.path}: Required value" + (f": {self.message}" if self.message else "")
        if self.kind in ("Too long", "Too many"):
            return f"{self.path}: {self.kind}: {self.message}"
        return f"{self.path}: {self.kind}: {show(self.value)}: {self.message}"


def show(value: Any) -> str:
    """A value as the API server prints it: strings quoted, objects and lists by their type."""
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value) if isinstance(value, float) else str(value)


def _num(v: Any) -> str:
    """A bound as Go prints it: 0 not 0.0."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


@functools.cache
def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the generated CRD (the same dict `kuberl crd` writes)."""
    return build_schema()


# ---------------------------------------------------------------------------------------------
# Pruning and defaulting (apiextensions-apiserver: strict decoding, null pruning, structural defaulting)
# ---------------------------------------------------------------------------------------------


def _child_schema(schema: dict[str, Any], key: str) -> dict[str, Any] | None:
    props = schema.get("properties")
    if props is not None:
        return props.get(key)
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def prune_and_default(schema: dict[str, Any], value: Any, path: str, errors: list[ValidationError]) -> Any:
    """A copy of `value` with unknown fields and nulls removed (unknown ones reported) and defaults applied."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        out = {}
        for key, item in value.items():
            sub = _child_schema(schema, key)
            if sub is None:
                if path != "metadata" and not schema.get("x-kubernetes-preserve-unknown-fields"):
                    errors.append(ValidationError(_join(path, key), item, "", kind="unknown field"))
                elif path == "metadata":
                    out[key] = copy.deepcopy(item)
                continue
            if item is None:  # non-nullable fields: nulls are pruned, then defaulted
                continue
            out[key] = prune_and_default(sub, item, _join(path, key), errors)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = prune_and_default(sub, copy.deepcopy(sub["default"]), _join(path, key), errors)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_and_default(schema["items"], v, _join(path, i), errors) for i, v in enumerate(value)]
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------------------------
# OpenAPI v3 schema (jsonschema, draft 4 = OpenAPI 3.0's boolean exclusiveMinimum/Maximum)
# ---------------------------------------------------------------------------------------------


def schema_error(err: jsonschema.ValidationError) -> ValidationError:
    path = ""
    for part in err.absolute_path:
        path = _join(path, part)
    v, inst = err.validator_value, err.instance
    where = f"{path} in body"
    match err.validator:
        case "type":
            expected = ",".join(v) if isinstance(v, list) else v
            return ValidationError(path, _json_type(inst), f'{where} must be of type {expected}: "{_json_type(inst)}"')
        case "anyOf" if err.schema.get("x-kubernetes-int-or-string"):
            return ValidationError(path, _json_type(inst), f'{where} must be of type integer,string: "{_json_type(inst)}"')
        case "enum":
            return ValidationError(path, inst, "supported values: " + ", ".join(show(x) for x in v), kind="Unsupported value")
        case "required":
            missing = [k for k in v if isinstance(inst, dict) and k not in inst]
            return ValidationError(_join(path, missing[0]) if missing else path, None, "", kind="Required value")
        case "minimum":
            op = "greater than" if err.schema.get("exclusiveMinimum") else "greater than or equal to"
            return ValidationError(path, inst, f"{where} should be {op} {_num(v)}")
        case "maximum":
            op = "less than" if err.schema.get("exclusiveMaximum") else "less than or equal to"
            return ValidationError(path, inst, f"{where} should be {op} {_num(v)}")
        case "pattern":
            return ValidationError(path, inst, f"{where} should match '{v}'")
        case "minLength":
            return ValidationError(path, inst, f"{where} should be at least {v} chars long")
        case "maxLength":
            return ValidationError(path, inst, f"may not be more than {v} bytes", kind="Too long")
        case "maxItems" | "maxProperties":
            return ValidationError(path, inst, f"{len(inst)}: must have at most {v} items", kind="Too many")
        case "minItems" | "minProperties":
            return ValidationError(path, inst, f"{where} should have at least {v} items")
    return ValidationError(path, inst, f"{where}: {err.message}")


@functools.cache
def _schema_validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(crd_schema())


def check_schema(doc: dict[str, Any]) -> list[ValidationError]:
    """Errors of `doc` (already pruned and defaulted) against the CRD's openAPIV3Schema."""
    errors = sorted(_schema_validator().iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    return [schema_error(e) for e in errors]


# ---------------------------------------------------------------------------------------------
# CEL rules (x-kubernetes-validations), self = the object at the rule's node
# ---------------------------------------------------------------------------------------------


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as CEL sees it through the schema: `type: number` is always a double, as in Kubernetes."""
    if schema.get("x-kubernetes-int-or-string") or (
        schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema
    ):
        return celpy.json_to_cel(value)
    match schema.get("type"):
        case "object":
            return celtypes.MapType(
                {celtypes.StringType(k): to_cel(_child_schema(schema, k) or {}, v) for k, v in value.items()}
            )
        case "array":
            return celtypes.ListType([to_cel(schema.get("items") or {}, v) for v in value])
        case "number":
            return celtypes.DoubleType(float(value))
        case "integer":
            return celtypes.IntType(value)
        case "boolean":
            return celtypes.BoolType(value)
        case "string":
            return celtypes.StringType(value)
    return celpy.json_to_cel(value)


_CEL_ENV = celpy.Environment()


@functools.cache
def compile_rule(rule: str) -> celpy.Runner:
    """A compiled CEL program (cached: every manifest checks the same few rules)."""
    return _CEL_ENV.program(_CEL_ENV.compile(rule))


def iter_rules(schema: dict[str, Any], path: str = ""):
    """(schema path, rule dict) for every x-kubernetes-validations rule under `schema`."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from iter_rules(sub, _join(path, key))
    if isinstance(schema.get("items"), dict):
        yield from iter_rules(schema["items"], path + "[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from iter_rules(schema["additionalProperties"], path + "[*]")


def evaluate_rule(rule: str, schema: dict[str, Any], value: Any) -> bool:
    """Evaluate one rule with self = value; raises celpy.CELEvalError where evaluation fails."""
    result = compile_rule(rule).evaluate({"self": to_cel(schema, value)})
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def check_cel(schema: dict[str, Any], value: Any, path: str = "") -> list[ValidationError]:
    """Evaluate every CEL rule where its node is present in `value` (pruned and defaulted)."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        where = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
        try:
            ok = evaluate_rule(rule["rule"], schema, value)
        except celpy.CELEvalError as exc:
            errors.append(ValidationError(where, value, f"rule {rule['rule']!r} failed to evaluate: {exc.args[0]}"))
            continue
        if not ok:
            errors.append(ValidationError(where, value, rule.get("message") or f"failed rule: {rule['rule']}"))
    if isinstance(value, dict):
        for key, item in value.items():
            sub = _child_schema(schema, key)
            if sub is not None:
                errors.extend(check_cel(sub, item, _join(path, key)))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors.extend(check_cel(schema["items"], item, _join(path, i)))
    return errors


# ---------------------------------------------------------------------------------------------
# The models' own checks (what the operator and `kuberl run` reject beyond admission)
# ---------------------------------------------------------------------------------------------


def check_models(doc: dict[str, Any]) -> list[ValidationError]:
    """Errors pydantic raises on the defaulted manifest (allocation contradictions and the like)."""
    try:
        RLExperiment.model_validate(doc)
    except pydantic.ValidationError as exc:
        out = []
        for err in exc.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, FieldError):
                out.append(ValidationError(cause.path, cause.value, str(cause)))
                continue
            path = ""
            for part in err["loc"]:
                path = _join(path, part)
            msg = err["msg"].removeprefix("Value error, ")
            out.append(ValidationError(path, err.get("input"), msg))
        return out
    return []


def validate_manifest(doc: dict[str, Any]) -> list[ValidationError]:
    """Every error admission (then the operator) would report for one RLExperiment manifest."""
    if doc.get("apiVersion") != API_VERSION:
        return [ValidationError("apiVersion", doc.get("apiVersion"), f"supported values: {show(API_VERSION)}", kind="Unsupported value")]
    if doc.get("kind") != KIND:
        return [ValidationError("kind", doc.get("kind"), f"supported values: {show(KIND)}", kind="Unsupported value")]
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not (meta.get("name") or meta.get("generateName")):
        return [ValidationError("metadata.name", None, "name or generateName is required", kind="Required value")]
    doc = {k: v for k, v in doc.items() if k != "status"}  # the status subresource ignores status on create
    if "name" not in meta:  # the API server generates it; any valid name stands in here
        doc["metadata"] = {**meta, "name": "generated"}
    errors: list[ValidationError] = []
    schema = crd_schema()
    defaulted = prune_and_default(schema, doc, "", errors)
    errors.extend(check_schema(defaulted))
    if errors:  # CEL rules assume a well-typed object, as the API server's do
        return errors
    errors.extend(check_cel(schema, defaulted))
    if errors:
        return errors
    return check_models(defaulted)


def main(args: argparse.Namespace) -> int:
    """`kuberl validate FILE...`: one line per error, `OK FILE` per good manifest; exit 1 on any error."""
    failed = False
    for file in args.files:
        try:
            docs = load_documents(file)
        except (OSError, ValueError) as exc:
            print(f"{file}: error: {exc}" if isinstance(exc, OSError) else f"error: {exc}")
            failed = True
            continue
        found = [d for d in docs if d.get("kind") == KIND]
        for d in docs:
            if d.get("kind") != KIND:
                name = (d.get("metadata") or {}).get("name", "?") if isinstance(d.get("metadata"), dict) else "?"
                print(f"{file}: note: skipping {d.get('kind') or 'a document without kind'} {name!r} (not an {KIND})")
        if not found:
            print(f"{file}: note: no {KIND} in this file")
        for i, d in enumerate(found):
            label = file if len(found) == 1 else f"{file}#{i + 1}"
            errors = validate_manifest(d)
            for e in errors:
                print(f"{label}: {e}")
            if errors:
                failed = True
            else:
                print(f"OK {label}")
    return 1 if failed else 0
