"""Pure pieces of Kubernetes API semantics for the strict emulator (kuberl.testing.kmock_strict): writing.

The four patch types (merge, strategic, JSON, server-side apply with managedFields), CRD admission
(structural pruning, defaults, openAPIV3Schema, CEL rules via cel-python) and the immutable fields of
the built-in kinds the operator updates. No I/O, no event loop: unit-tested on their own.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import jsonschema

from kuberl.testing.kube_semantics import ApiError, Obj, now_rfc3339

# ---------------------------------------------------------------------------------------------
# Patches
# ---------------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Merge keys of the lists a strategic merge patch merges by element (k8s.io/api patchMergeKey tags).
STRATEGIC_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "ports": "containerPort", "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "conditions": "type", "ownerReferences": "uid", "imagePullSecrets": "name", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey", "finalizers": None, "tolerations": None,
}


def strategic_merge_patch(target: Any, patch: Any, parent_key: str | None = None) -> Any:
    """A strategic merge patch as kubectl sends it: merge patch plus keyed list merging and the
    $patch / $setElementOrder / $retainKeys / $deleteFromPrimitiveList directives."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name, []) if x not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and STRATEGIC_MERGE_KEYS.get(key) and isinstance(result.get(key), list):
            mk = STRATEGIC_MERGE_KEYS[key]
            merged = copy.deepcopy(result[key])
            for item in value:
                if not isinstance(item, dict) or mk not in item:
                    merged.append(copy.deepcopy(item))
                    continue
                idx = next((i for i, x in enumerate(merged) if isinstance(x, dict) and x.get(mk) == item[mk]), None)
                if item.get("$patch") == "delete":
                    if idx is not None:
                        merged.pop(idx)
                elif idx is None:
                    merged.append(strategic_merge_patch({}, item))
                else:
                    merged[idx] = strategic_merge_patch(merged[idx], item)
            result[key] = merged
        else:
            new = strategic_merge_patch(result.get(key), value, key)
            if new is None:
                result.pop(key, None)
            else:
                result[key] = new
    return result


def json_patch(target: Obj, ops: Any) -> Obj:
    """RFC 6902 JSON patch; a failed `test` or a bad path is 422, as the API server answers."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(copy.deepcopy(target), ops)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {exc}") from exc
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError, IndexError) as exc:
        raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {exc}") from exc


def field_set(obj: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Leaf paths of a manifest (maps are descended, lists are leaves): what an applier owns."""
    if not isinstance(obj, dict) or not obj:
        return {prefix} if prefix else set()
    out: set[tuple[str, ...]] = set()
    for key, value in obj.items():
        out |= field_set(value, prefix + (key,))
    return out


def fields_v1(paths: set[tuple[str, ...]]) -> Obj:
    """managedFields.fieldsV1 form ("f:spec": {"f:replicas": {}}) of a set of leaf paths."""
    root: Obj = {}
    for path in paths:
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def paths_of_fields_v1(fv1: Obj, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for key, value in fv1.items():
        if not key.startswith("f:"):
            continue
        path = prefix + (key[2:],)
        out |= paths_of_fields_v1(value, path) if value else {path}
    return out


def _remove_path(obj: Obj, path: tuple[str, ...]) -> None:
    chain = [obj]
    for key in path[:-1]:
        nxt = chain[-1].get(key)
        if not isinstance(nxt, dict):
            return
        chain.append(nxt)
    chain[-1].pop(path[-1], None)
    for depth in range(len(chain) - 1, 0, -1):  # prune the maps the removal emptied
        if not chain[depth]:
            chain[depth - 1].pop(path[depth - 1], None)


def server_side_apply(existing: Obj | None, applied: Obj, manager: str) -> Obj:
    """Server-side apply for a manager that owns what it applies (force): fields it applied before
    and leaves out now are removed; maps merge; lists are replaced (atomic ownership)."""
    base = copy.deepcopy(existing) if existing else {}
    managed = [m for m in base.get("metadata", {}).get("managedFields", []) if isinstance(m, dict)]
    previous = next((m for m in managed if m.get("manager") == manager and m.get("operation") == "Apply"), None)
    now = field_set({k: v for k, v in applied.items() if k not in ("apiVersion", "kind")})
    now = {p for p in now if p[:2] not in (("metadata", "managedFields"), ("metadata", "resourceVersion"))}
    if previous:
        for path in paths_of_fields_v1(previous.get("fieldsV1", {})) - now:
            if path[0] != "status":
                _remove_path(base, path)
    merged = _apply_merge(base, applied)
    entry = {"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion", ""),
             "time": now_rfc3339(), "fieldsType": "FieldsV1", "fieldsV1": fields_v1(now)}
    merged.setdefault("metadata", {})["managedFields"] = [m for m in managed if m is not previous] + [entry]
    return merged


def _apply_merge(base: Any, applied: Any) -> Any:
    if isinstance(base, dict) and isinstance(applied, dict):
        out = dict(base)
        for key, value in applied.items():
            out[key] = _apply_merge(base.get(key), value)
        return out
    return copy.deepcopy(applied)


# ---------------------------------------------------------------------------------------------
# CRD admission: pruning, defaults, schema, CEL
# ---------------------------------------------------------------------------------------------


def _to_jsonschema(schema: Any) -> Any:
    """openAPIV3Schema -> JSON Schema: nullable, int-or-string, preserve-unknown-fields."""
    if isinstance(schema, list):
        return [_to_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _to_jsonschema(v) for k, v in schema.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("anyOf", None)
        pattern = out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(schema.get(bound), bool):  # OpenAPI 3.0 booleans -> JSON Schema numbers
            out.pop(bound)
            if schema[bound] and limit in out:
                out[bound] = out.pop(limit)
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def prune_and_default(value: Any, schema: Obj, path: str, unknown: list[str]) -> Any:
    """Drop fields the structural schema does not know (recording them) and fill in defaults."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict) and schema.get("type") == "object" or (isinstance(value, dict) and "properties" in schema):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False)
        out = {}
        for key, item in value.items():
            if props is not None and key in props:
                out[key] = prune_and_default(item, props[key], f"{path}.{key}", unknown)
            elif isinstance(addl, dict):
                out[key] = prune_and_default(item, addl, f"{path}.{key}", unknown)
            elif keep_unknown or addl is True or (props is None and addl is None):
                out[key] = item
            else:
                unknown.append(f"{path}.{key}")
        for key, sub in (props or {}).items():
            if key not in out and isinstance(sub, dict) and "default" in sub:
                out[key] = prune_and_default(copy.deepcopy(sub["default"]), sub, f"{path}.{key}", unknown)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_and_default(v, schema["items"], f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return value


class CrdAdmission:
    """Validates custom resources against their CRD version's openAPIV3Schema and CEL rules."""

    def __init__(self, schema: Obj):
        self.schema = schema
        self.validator = jsonschema.Draft202012Validator(_to_jsonschema(schema))
        # (schema node, rule, JSON of the value it checks) -> error message or None: a CEL rule is a pure function
        # of its (schema-typed) value, and a status write re-validates the same spec every time.
        self._cel_results: dict[tuple[int, str, str], str | None] = {}

    def admit(self, obj: Obj, strict_fields: bool) -> tuple[Obj, list[tuple[str, str]], list[str]]:
        """(pruned and defaulted object, errors as (field, message), unknown fields dropped)."""
        unknown: list[str] = []
        body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        body = prune_and_default(body, self.schema, "", unknown)
        result = {**{k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}, **body}
        errors: list[tuple[str, str]] = []
        if strict_fields and unknown:
            errors += [(u.lstrip("."), "field not declared in schema") for u in unknown]
        for err in self.validator.iter_errors(body):
            where = ".".join(str(p) for p in err.absolute_path) or "<root>"
            errors.append((where, err.message))
        if not errors:
            errors += self._cel(body, self.schema, "")
        return result, errors, unknown

    def _cel(self, value: Any, schema: Obj, path: str) -> list[tuple[str, str]]:
        from kuberl.api.validation import compile_rule, to_cel

        errors: list[tuple[str, str]] = []
        if not isinstance(schema, dict) or value is None:
            return errors
        for rule in schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue  # transition rules need the old object; creation-time admission skips them
            memo_key = (id(schema), rule["rule"], json.dumps(value, sort_keys=True, default=repr))
            if memo_key in self._cel_results:
                failure = self._cel_results[memo_key]
            else:
                # kuberl validate's CEL: Kubernetes' functions (find, matches with Go's regex), as the API server has them
                prog = compile_rule(rule["rule"])
                try:
                    # Typed by the schema, as the API server does (`type: number` is a double even when
                    # the JSON says 1): json_to_cel would make 1 an int and `self.topP == 1.0` fail to evaluate.
                    ok = bool(prog.evaluate({"self": to_cel(schema, value)}))
                    failure = None if ok else (rule.get("message") or f"failed rule: {rule['rule']}")
                except Exception as exc:  # noqa: BLE001 - any evaluation error rejects, as in the API server
                    failure = f"CEL rule {rule['rule']!r} failed to evaluate: {exc}"
                if len(self._cel_results) >= 20000:
                    self._cel_results.clear()
                self._cel_results[memo_key] = failure
            if failure is not None:
                errors.append((path.lstrip(".") or "<root>", failure))
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    errors += self._cel(value[key], sub, f"{path}.{key}")
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += self._cel(item, schema["items"], f"{path}[{i}]")
        return errors


# ---------------------------------------------------------------------------------------------
# Immutable fields of the built-in kinds the operator updates (the API server's update validation)
# ---------------------------------------------------------------------------------------------

STATEFULSET_MUTABLE = {"replicas", "ordinals", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                       "minReadySeconds", "revisionHistoryLimit"}
# Pod template fields a suspended, never-started Job may still change (KEP-2926).
JOB_SCHEDULING_FIELDS = {"nodeSelector", "tolerations", "affinity", "schedulingGates"}


def immutable_violations(plural: str, old: Obj, new: Obj) -> list[tuple[str, str]]:
    """Changes the API server forbids on update, as (field, message)."""
    o, n = old.get("spec") or {}, new.get("spec") or {}
    if plural == "statefulsets":
        changed = sorted(k for k in set(o) | set(n) if k not in STATEFULSET_MUTABLE and o.get(k) != n.get(k))
        if changed:
            message = ("Forbidden: updates to statefulset spec for fields other than 'replicas', 'ordinals', "
                       "'template', 'updateStrategy', 'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' "
                       "are forbidden")  # as kube-apiserver says it: the changed fields are not named
            return [("spec", message)]
    if plural == "jobs":
        out = []
        for key in ("selector", "completions", "completionMode", "manualSelector"):
            if key in o and o.get(key) != n.get(key):
                out.append((f"spec.{key}", "Invalid value: field is immutable"))
        ot, nt = copy.deepcopy(o.get("template") or {}), copy.deepcopy(n.get("template") or {})
        if o.get("suspend") and not (old.get("status") or {}).get("startTime"):
            for t in (ot, nt):
                t.pop("metadata", None)
                for f in JOB_SCHEDULING_FIELDS:
                    (t.get("spec") or {}).pop(f, None)
        if ot != nt:
            out.append(("spec.template", "Invalid value: field is immutable"))
        return out
    if plural == "persistentvolumeclaims":
        def strip(s: dict) -> dict:
            return {k: v for k, v in s.items() if k != "resources"}

        if strip(o) != strip(n):
            return [("spec", "Forbidden: spec is immutable after creation except resources.requests and volumeAttributesClassName")]
    return []
