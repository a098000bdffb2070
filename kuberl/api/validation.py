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
import re
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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def decode_numbers(value: Any) -> Any:
    """JSON numbers as the API server decodes them: an integer literal that fits an int64 stays an integer, a bigger one
    becomes a float64 (2**63); a literal with a fraction or exponent is a float64 even when whole (1.0): see `_is_integer`."""
    if isinstance(value, dict):
        return {k: decode_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_numbers(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        return float(value)
    return value


def unknown_fields(schema: dict[str, Any] | None, value: Any, path: str, errors: list[ValidationError]) -> None:
    """Report the fields pruning would drop, as the API server's pruning walks (apiextensions-apiserver pruning/algorithm.go):
    an object under a schema without properties or additionalProperties loses all its fields, a list under a schema
    without items has its objects' fields dropped, preserve-unknown-fields keeps what it does not declare."""
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(value, dict):
            for key, item in value.items():
                sub = _child_schema(schema, key)
                if sub is not None:
                    unknown_fields(sub, item, _join(path, key), errors)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(schema.get("items"), dict) and schema["items"].get("x-kubernetes-preserve-unknown-fields"):
                    unknown_fields(schema["items"], item, _join(path, i), errors)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            sub = None if schema is None else _child_schema(schema, key)
            if sub is None:
                errors.append(ValidationError(_join(path, key), item, "", kind="unknown field"))
            else:
                unknown_fields(sub, item, _join(path, key), errors)
    elif isinstance(value, list):
        items = schema.get("items") if schema is not None else None
        for i, item in enumerate(value):
            unknown_fields(items if isinstance(items, dict) else None, item, _join(path, i), errors)


def prune_and_default(schema: dict[str, Any], value: Any, path: str, errors: list[ValidationError]) -> Any:
    """A copy of `value` with unknown fields and nulls removed (unknown ones reported) and defaults applied."""
    unknown_fields(schema, value, path, errors)
    return _prune_and_default(schema, value)


def _prune_and_default(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and (schema.get("type") == "object" or schema.get("x-kubernetes-preserve-unknown-fields")):
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return copy.deepcopy(value)
        out = {}
        for key, item in value.items():
            sub = _child_schema(schema, key)
            if sub is None:  # unknown: kept under preserve-unknown-fields, else pruned
                if schema.get("x-kubernetes-preserve-unknown-fields"):
                    out[key] = copy.deepcopy(item)
                continue
            if item is None:  # non-nullable fields: nulls are pruned, then defaulted
                continue
            out[key] = _prune_and_default(sub, item)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = _prune_and_default(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune_and_default(schema["items"], v) for v in value]
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------------------------
# metadata: the API server decodes it into metav1.ObjectMeta (strictly) and validates it (ValidateObjectMeta)
# ---------------------------------------------------------------------------------------------

# ObjectMeta's JSON fields and the JSON types they decode from (null decodes into any of them).
OBJECT_META: dict[str, tuple[type, ...]] = {
    "name": (str,), "generateName": (str,), "namespace": (str,), "selfLink": (str,), "uid": (str,), "resourceVersion": (str,),
    "generation": (int,), "creationTimestamp": (str,), "deletionTimestamp": (str,), "deletionGracePeriodSeconds": (int,),
    "labels": (dict,), "annotations": (dict,), "ownerReferences": (list,), "finalizers": (list,), "managedFields": (list,),
}
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")
MAX_GENERATED_NAME_PREFIX = 58  # names.MaxGeneratedNameLength: 63 - 5 random characters
ANNOTATIONS_MAX_BYTES = 256 * 1024


def _is_qualified_name(key: str) -> bool:
    """apimachinery IsQualifiedName: an optional DNS-1123 subdomain prefix and `/`, then a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.fullmatch(name))


def decode_metadata(meta: dict[str, Any]) -> list[ValidationError]:
    """metadata as the API server decodes it into metav1.ObjectMeta: unknown fields (strict) and Go types (a type error
    fails the whole request before anything is validated)."""
    errors = []
    for key, value in meta.items():
        if key not in OBJECT_META:
            errors.append(ValidationError(f"metadata.{key}", value, "", kind="unknown field"))
        elif value is None:  # null decodes into any Go field as its zero value
            continue
        elif not isinstance(value, OBJECT_META[key]) or isinstance(value, bool):
            errors.append(ValidationError(f"metadata.{key}", value, f"cannot unmarshal {_json_type(value)} into ObjectMeta.{key}"))
        elif key in ("labels", "annotations") and any(v is not None and not isinstance(v, str) for v in value.values()):
            errors.append(ValidationError(f"metadata.{key}", value, f"cannot unmarshal into ObjectMeta.{key} of type map[string]string"))
        elif key in ("finalizers", "ownerReferences", "managedFields"):
            want = str if key == "finalizers" else dict
            if any(v is not None and not isinstance(v, want) for v in value):
                errors.append(ValidationError(f"metadata.{key}", value, f"cannot unmarshal into ObjectMeta.{key}"))
        elif key.endswith("Timestamp") and not _RFC3339.fullmatch(value):
            errors.append(ValidationError(f"metadata.{key}", value, f"parsing time {value!r} as RFC 3339"))
    return errors


def check_metadata(meta: dict[str, Any]) -> list[ValidationError]:
    """metadata (decoded) as the API server validates it: labels, annotations, finalizers, owner references, generateName.
    The name's own rules are the CRD's schema, checked with the rest."""
    errors = []
    for key, value in (meta.get("labels") or {}).items():
        if not _is_qualified_name(key):
            errors.append(ValidationError("metadata.labels", key, "a label key must be a qualified name"))
        if value and (len(value) > 63 or not _QUALIFIED_NAME.fullmatch(value)):
            errors.append(ValidationError("metadata.labels", value, "a valid label must be an empty string or 63 alphanumeric characters, '-', '_' or '.'"))
    annotations = meta.get("annotations") or {}
    for key in annotations:
        if not _is_qualified_name(key.lower()):
            errors.append(ValidationError("metadata.annotations", key, "an annotation key must be a qualified name"))
    if sum(len(k.encode()) + len((v or "").encode()) for k, v in annotations.items()) > ANNOTATIONS_MAX_BYTES:
        errors.append(ValidationError("metadata.annotations", "", f"may not be more than {ANNOTATIONS_MAX_BYTES} bytes", kind="Too long"))
    for value in meta.get("finalizers") or []:
        if not _is_qualified_name(value or ""):
            errors.append(ValidationError("metadata.finalizers", value or "", "a finalizer must be a qualified name"))
    for ref in meta.get("ownerReferences") or []:
        for key in ("apiVersion", "kind", "name", "uid"):
            if not isinstance((ref or {}).get(key), str) or not ref[key]:
                errors.append(ValidationError(f"metadata.ownerReferences.{key}", "", "must not be empty"))  # no index, as the server
    prefix = meta.get("generateName")
    masked = prefix[:-2] + "a" if prefix and len(prefix) > 1 and prefix.endswith("-") else prefix  # maskTrailingDash, as it is
    if prefix and (len(masked) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(masked)):
        errors.append(ValidationError("metadata.generateName", prefix, "a lowercase RFC 1123 subdomain must consist of lower case "
                                      "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"))
    return errors


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
def go_regex(pattern: str) -> re.Pattern[str]:
    """A Go regexp (RE2: the API server's `pattern` and CEL's matches()) as a Python pattern that means the same:
    `$` only at the very end (Python's also matches before a final newline), \\d \\w ASCII, \\s = [\\t\\n\\f\\r ] (no \\v)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            esc, i = pattern[i:i + 2], i + 2
            if esc == "\\S" and in_class:
                raise ValueError(f"{pattern!r}: \\S inside a character class is not translated")
            out.append({"\\s": " \\t\\n\\f\\r" if in_class else "[ \\t\\n\\f\\r]", "\\S": "[^ \\t\\n\\f\\r]"}.get(esc, esc))
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):  # a leading ^ negates, a first ] is literal
                if pattern[i:i + 1] == lead:
                    out.append(lead)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append("\\Z" if c == "$" and not in_class else c)
        i += 1
    return re.compile("".join(out), re.ASCII)


MAX_JSON_FLOAT = float(2**53 - 1)


def _is_integer(_checker: Any, value: Any) -> bool:
    """kube-openapi's `type: integer`: an int64, or a float64 that go-openapi's swag.IsFloat64AJSONInteger takes (|f| up to
    2**53 - 1, within a relative 1e-9 of its conversion to a whole number: 1.0, 1e2 and 3.0000000001 are integers there)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, int):
        return True
    if value != value or abs(value) > MAX_JSON_FLOAT:  # NaN, inf and beyond 2**53
        return False
    as_uint = float(int(value) % 2**64)  # Go's uint64(f) on amd64 (two's complement below zero)
    if value == as_uint or value == float(int(value)):
        return True
    if value == 0 or as_uint == 0:
        return False  # diff < 1e-9 * SmallestNonzeroFloat64, which is 0
    return abs(value - as_uint) / (abs(value) + as_uint) < 1e-9


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Any:
    if isinstance(instance, str) and not go_regex(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _enum(validator: Any, enums: list[Any], instance: Any, schema: dict[str, Any]) -> Any:
    """kube-openapi converts the value to each enum value's Go type before comparing: a float64 against int64 values is
    truncated (3.0000000001 is 3); otherwise JSON equality (a boolean is no number)."""
    for e in enums:
        if isinstance(e, bool) or isinstance(instance, bool):
            if e is instance:
                return
        elif isinstance(e, int) and isinstance(instance, float):
            if int(instance) == e:
                return
        elif type(e) is type(instance) and e == instance:
            return
    yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")


# Draft 4 (OpenAPI 3.0's boolean exclusiveMinimum) with the API server's integers, enums and Go regexps.
KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"pattern": _pattern, "enum": _enum},
    type_checker=jsonschema.Draft4Validator.TYPE_CHECKER.redefine("integer", _is_integer),
)


@functools.cache
def _schema_validator() -> Any:
    return KubeValidator(crd_schema())


def check_schema(doc: dict[str, Any]) -> list[ValidationError]:
    """Errors of `doc` (already pruned and defaulted) against the CRD's openAPIV3Schema."""
    out = []
    for err in sorted(_schema_validator().iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
        if err.validator == "required" and isinstance(err.instance, dict):  # one error per missing field, as the API server
            where = ""
            for part in err.absolute_path:
                where = _join(where, part)
            out += [ValidationError(_join(where, k), None, "", kind="Required value") for k in err.validator_value if k not in err.instance]
        else:
            out.append(schema_error(err))
    return out


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
        case "integer":  # a whole float64 passes the schema but not CEL's int conversion: an error where a rule uses it
            return _FloatInIntegerField(int(value)) if isinstance(value, float) else celtypes.IntType(value)
        case "boolean":
            return celtypes.BoolType(value)
        case "string":
            return celtypes.StringType(value)
    return celpy.json_to_cel(value)


class _FloatInIntegerField(celtypes.IntType):
    """An integer field that holds a float64 (1.0): the API server's CEL fails on it ("invalid data, expected int, got
    float64") where a rule reads it, as an error value (so `true || it` is still true); has() of it fails too (_KubeEvaluator)."""

    def _fail(self, *_: Any) -> Any:
        raise TypeError("invalid data, expected int, got float64")

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __mod__ = __rmod__ = __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __neg__ = _fail
    __hash__ = celtypes.IntType.__hash__


def _cel_matches(text: Any, pattern: Any) -> celtypes.BoolType:
    """CEL's string.matches(re) with RE2's meaning (celpy's own uses Python's re)."""
    return celtypes.BoolType(go_regex(str(pattern)).search(str(text)) is not None)


def _cel_find(text: Any, pattern: Any) -> celtypes.StringType:
    """Kubernetes CEL's string.find(re) (its regex library): the first match, '' where none (celpy has no find)."""
    m = go_regex(str(pattern)).search(str(text))
    return celtypes.StringType(m.group(0) if m else "")


class _KubeEvaluator(celpy.evaluation.Evaluator):
    """celpy's evaluator, but has() of a float64 in an integer field is an error, as the API server's lazy conversion makes it
    (`has(self.epochs)` with epochs 3.0 fails to evaluate there; celpy would say true)."""

    def macro_has_eval(self, exprlist: Any) -> Any:
        value = self.visit_children(exprlist)[0]
        if isinstance(value, _FloatInIntegerField):
            return celpy.CELEvalError("invalid data, expected int, got float64")
        return celtypes.BoolType(not isinstance(value, celpy.CELEvalError))


class _KubeRunner(celpy.InterpretedRunner):
    def evaluate(self, context: Any) -> Any:
        return _KubeEvaluator(ast=self.ast, activation=self.new_activation()).evaluate(context)


_CEL_ENV = celpy.Environment(runner_class=_KubeRunner)


@functools.cache
def compile_rule(rule: str) -> celpy.Runner:
    """A compiled CEL program (cached: every manifest checks the same few rules)."""
    return _CEL_ENV.program(_CEL_ENV.compile(rule), functions={"matches": _cel_matches, "find": _cel_find})


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


def evaluate_rule(rule: str, schema: dict[str, Any], value: Any, cel_value: Any = None) -> bool:
    """Evaluate one rule with self = value (`cel_value`: the value already through to_cel); raises celpy.CELEvalError where evaluation fails."""
    result = compile_rule(rule).evaluate({"self": to_cel(schema, value) if cel_value is None else cel_value})
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def check_cel(schema: dict[str, Any], value: Any, path: str = "") -> list[ValidationError]:
    """Evaluate every CEL rule where its node is present in `value` (pruned and defaulted)."""
    errors = []
    rules = schema.get("x-kubernetes-validations", [])
    cel_value = to_cel(schema, value) if rules else None  # once per node: the conversion costs as much as the rules
    for rule in rules:
        where = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
        try:
            ok = evaluate_rule(rule["rule"], schema, value, cel_value)
        except celpy.CELEvalError as exc:
            # reported where the rule sits, not at its fieldPath, as the API server reports an evaluation error
            errors.append(ValidationError(path, value, f"rule {rule['rule']!r} failed to evaluate: {exc.args[0]}"))
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


def _blocking(error: ValidationError) -> bool:
    """Errors after which the API server does not run the CEL rules ("some validation rules were not checked"): unknown
    fields (the request stops at decoding), wrong types, enums, required fields, too long, too many. A pattern or a
    bound violated does not stop them."""
    return error.kind in ("unknown field", "Unsupported value", "Required value", "Too long", "Too many") or "must be of type" in error.message


def check_admission(doc: dict[str, Any]) -> tuple[list[ValidationError], dict[str, Any] | None]:
    """What the API server decides on create: its errors, and the object it would store (pruned and defaulted; None if rejected)."""
    if doc.get("apiVersion") != API_VERSION:
        return [ValidationError("apiVersion", doc.get("apiVersion"), f"supported values: {show(API_VERSION)}", kind="Unsupported value")], None
    if doc.get("kind") != KIND:
        return [ValidationError("kind", doc.get("kind"), f"supported values: {show(KIND)}", kind="Unsupported value")], None
    meta = {} if doc.get("metadata") is None else doc["metadata"]  # null decodes as an empty ObjectMeta
    if not isinstance(meta, dict):
        return [ValidationError("metadata", meta, f"cannot unmarshal {_json_type(meta)} into ObjectMeta")], None
    doc = decode_numbers({**doc, "metadata": meta})
    meta, schema = doc["metadata"], crd_schema()
    errors = decode_metadata(meta)
    if any(e.kind != "unknown field" for e in errors):  # undecodable: the API server answers with that alone
        return errors, None
    # Strict decoding names unknown fields anywhere, status included (the status subresource drops status only afterwards).
    unknown_fields(schema["properties"]["status"], doc.get("status"), "status", errors)
    defaulted = prune_and_default(schema, {k: v for k, v in doc.items() if k not in ("metadata", "status")}, "", errors)
    errors.extend(check_metadata(meta))
    if not meta.get("name") and not meta.get("generateName"):
        errors.append(ValidationError("metadata.name", None, "name or generateName is required", kind="Required value"))
    elif not meta.get("name"):  # the API server appends 5 random letters and digits to generateName (cut to 58)
        meta = {**meta, "name": meta["generateName"][:MAX_GENERATED_NAME_PREFIX] + "xxxxx"}
    defaulted["metadata"] = copy.deepcopy(meta)
    errors.extend(check_schema(defaulted))
    rollout = defaulted["spec"].get("rollout") if isinstance(defaulted.get("spec"), dict) else None
    replicas = rollout.get("replicas") if isinstance(rollout, dict) else None
    if isinstance(replicas, float):  # the /scale subresource's specReplicasPath is read as an int64
        errors.append(ValidationError(".spec.rollout.replicas", 0, f".spec.rollout.replicas accessor error: {replicas} is of the type float64, expected int64"))
    if any(_blocking(e) for e in errors):  # CEL rules need a well-typed, complete object, as the API server's do
        return errors, None
    errors.extend(check_cel(schema, defaulted))
    return errors, None if errors else defaulted


def validate_manifest(doc: dict[str, Any]) -> list[ValidationError]:
    """Every error admission (then the operator) would report for one RLExperiment manifest."""
    errors, stored = check_admission(doc)
    return errors if stored is None else check_models(stored)


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
