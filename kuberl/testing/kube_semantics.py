"""Pure pieces of Kubernetes API semantics for the strict emulator (kuberl.testing.kmock_strict).

Resource types, the four patch types (merge, strategic, JSON, server-side apply), label and field
selectors, Table rendering of printer columns, and CRD structural-schema admission (pruning,
defaults, openAPIV3Schema, CEL rules). No I/O, no event loop: unit-testable on their own.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import jsonschema

Obj = dict[str, Any]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class ApiError(Exception):
    """An API failure rendered as a metav1.Status (code, reason, message, details)."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> Obj:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "details": self.details, "code": self.code}


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.plural}{"." + rt.group if rt.group else ""} "{name}" not found',
                    {"name": name, "group": rt.group, "kind": rt.plural})


def invalid(rt: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    text = "; ".join(f"{f}: {m}" for f, m in causes)
    return ApiError(422, "Invalid", f'{rt.kind}.{rt.group or "core"} "{name}" is invalid: {text}',
                    {"name": name, "group": rt.group, "kind": rt.kind,
                     "causes": [{"reason": "FieldValueInvalid", "field": f, "message": m} for f, m in causes]})


@dataclass
class ScaleSpec:
    """Where a /scale subresource reads and writes: JSON paths like .spec.replicas."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None  # None: built-ins derive it from .spec.selector


@dataclass
class ResourceType:
    """One served resource: discovery data plus what the emulator needs to act like the API server."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    status: bool = False  # has a status subresource (status isolated from the main resource)
    scale: ScaleSpec | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    crd: Obj | None = None  # the CRD that defines it (schema, CEL rules), None for built-ins

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    def discovery(self) -> list[Obj]:
        base = {"name": self.plural, "singularName": self.singular, "namespaced": self.namespaced,
                "kind": self.kind, "verbs": VERBS, "shortNames": self.short_names, "categories": self.categories}
        out = [base]
        if self.status:
            out.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                        "kind": self.kind, "verbs": ["get", "patch", "update"]})
        if self.scale:
            out.append({"name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                        "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
        return out


def _rt(api: str, plural: str, kind: str, namespaced: bool = True, short: tuple[str, ...] = (), status: bool = False,
        scale: bool = False) -> ResourceType:
    group, _, version = api.rpartition("/")
    return ResourceType(group, version, plural, kind, namespaced, list(short), [], status, ScaleSpec() if scale else None)


# The built-in kinds the operator creates or reads, and what kopf and kubectl touch.
BUILTIN_RESOURCES: list[ResourceType] = [
    _rt("v1", "namespaces", "Namespace", False, ("ns",), status=True),
    _rt("v1", "nodes", "Node", False, ("no",), status=True),
    _rt("v1", "pods", "Pod", short=("po",), status=True),
    _rt("v1", "services", "Service", short=("svc",), status=True),
    _rt("v1", "endpoints", "Endpoints", short=("ep",)),
    _rt("v1", "configmaps", "ConfigMap", short=("cm",)),
    _rt("v1", "secrets", "Secret"),
    _rt("v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _rt("v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), status=True),
    _rt("v1", "events", "Event", short=("ev",)),
    _rt("apps/v1", "statefulsets", "StatefulSet", short=("sts",), status=True, scale=True),
    _rt("apps/v1", "deployments", "Deployment", short=("deploy",), status=True, scale=True),
    _rt("batch/v1", "jobs", "Job", status=True),
    _rt("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _rt("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _rt("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", False),
    _rt("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _rt("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short=("netpol",)),
    _rt("coordination.k8s.io/v1", "leases", "Lease"),
    _rt("events.k8s.io/v1", "events", "Event", short=("ev",)),
    _rt("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", short=("pdb",), status=True),
    _rt("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", short=("hpa",), status=True),
    _rt("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition", False, ("crd", "crds"), status=True),
]


def resource_from_crd(crd: Obj) -> list[ResourceType]:
    """The served versions of a CRD as ResourceTypes (subresources, printer columns, schema)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for ver in spec.get("versions", []):
        if not ver.get("served", True):
            continue
        sub = ver.get("subresources") or {}
        scale = None
        if "scale" in sub:
            s = sub["scale"]
            scale = ScaleSpec(s["specReplicasPath"], s["statusReplicasPath"], s.get("labelSelectorPath"))
        out.append(ResourceType(
            spec["group"], ver["name"], names["plural"], names["kind"], spec.get("scope", "Namespaced") == "Namespaced",
            list(names.get("shortNames", [])), list(names.get("categories", [])), "status" in sub, scale,
            list(ver.get("additionalPrinterColumns", [])), crd))
    return out


# ---------------------------------------------------------------------------------------------
# Paths and selectors
# ---------------------------------------------------------------------------------------------

_SEGMENT = re.compile(r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_]+)==[\"']([^\"']*)[\"']\)\]")


def json_path_get(obj: Any, path: str) -> Any:
    """Value at a simple JSONPath (.a.b, .a[0], .a[?(@.type=="Ready")]); None where absent."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    pos, cur = 0, obj
    while pos < len(path):
        m = _SEGMENT.match(path, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos = m.end()
        key, index, fkey, fval = m.groups()
        if key is not None:
            cur = cur.get(key) if isinstance(cur, dict) else None
        elif index is not None:
            cur = cur[int(index)] if isinstance(cur, list) and int(index) < len(cur) else None
        else:
            cur = next((x for x in cur if isinstance(x, dict) and str(x.get(fkey)) == fval), None) if isinstance(cur, list) else None
        if cur is None:
            return None
    return cur


def json_path_set(obj: Obj, path: str, value: Any) -> None:
    keys = [k for k in path.strip(".").split(".") if k]
    for k in keys[:-1]:
        obj = obj.setdefault(k, {})
    obj[keys[-1]] = value


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def label_selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Kubernetes label selector syntax: a=b, a==b, a!=b, a in (x,y), a notin (x), a, !a."""
    for req in _split_selector(selector or ""):
        if m := re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\((.*)\)", req):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            ok = (labels.get(key) in values) if op == "in" else (labels.get(key) not in values)
        elif m := re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*(\S*)", req):
            key, op, value = m.groups()
            ok = labels.get(key) == value if op != "!=" else labels.get(key) != value
        elif req.startswith("!"):
            ok = req[1:].strip() not in labels
        elif re.fullmatch(r"[^\s!=(),]+", req):
            ok = req in labels
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {req!r}")
        if not ok:
            return False
    return True


def field_selector_matches(selector: str | None, obj: Obj) -> bool:
    """Field selectors: path=value, path==value, path!=value (metadata.name, involvedObject.uid, ...)."""
    for req in _split_selector(selector or ""):
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", req)
        if not m:
            raise ApiError(400, "BadRequest", f"invalid field selector: {req!r}")
        path, op, value = m.groups()
        actual = json_path_get(obj, "." + path)
        actual = "" if actual is None else str(actual)
        if (actual == value) != (op != "!="):
            return False
    return True


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
# Tables (kubectl get)
# ---------------------------------------------------------------------------------------------


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def human_age(timestamp: str | None) -> str:
    """Age as kubectl prints it (duration.HumanDuration, shortened): 5s, 3m, 2h, 4d."""
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(timestamp)
    secs = max(0, int((dt.datetime.now(dt.UTC) - then).total_seconds()))
    if secs < 120:
        return f"{secs}s"
    if secs < 600:
        return f"{secs // 60}m{secs % 60}s" if secs % 60 else f"{secs // 60}m"
    if secs < 3 * 3600:
        return f"{secs // 60}m"
    if secs < 48 * 3600:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def table_columns(rt: ResourceType) -> list[Obj]:
    cols = [{"name": "Name", "type": "string", "format": "name", "description": "Name of the object", "priority": 0}]
    if rt.crd is not None:
        for c in rt.printer_columns:
            cols.append({"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                         "description": c.get("description", ""), "priority": c.get("priority", 0)})
        if not rt.printer_columns:
            cols.append({"name": "Age", "type": "date", "format": "", "description": "Age", "priority": 0})
        return cols
    extra = {"statefulsets": [("Ready", ".status.readyReplicas", ".spec.replicas")],
             "jobs": [("Status", ".status.succeeded", None)],
             "pods": [("Status", ".status.phase", None)],
             "events": [("Type", ".type", None), ("Reason", ".reason", None), ("Object", ".involvedObject.name", None),
                        ("Message", ".message", None)]}.get(rt.plural, [])
    for name, _, _ in extra:
        cols.append({"name": name, "type": "string", "format": "", "description": name, "priority": 0})
    cols.append({"name": "Age", "type": "string", "format": "", "description": "Age", "priority": 0})
    return cols


def table_row(rt: ResourceType, obj: Obj, include: str) -> Obj:
    meta = obj.get("metadata", {})
    cells: list[Any] = [meta.get("name")]
    if rt.crd is not None:
        for c in rt.printer_columns:
            value = json_path_get(obj, c["jsonPath"])
            if c.get("type") == "date" and isinstance(value, str):
                value = human_age(value)
            cells.append(value)
        if not rt.printer_columns:
            cells.append(human_age(meta.get("creationTimestamp")))
    else:
        if rt.plural == "statefulsets":
            cells.append(f"{json_path_get(obj, '.status.readyReplicas') or 0}/{json_path_get(obj, '.spec.replicas') or 0}")
        elif rt.plural == "jobs":
            st = obj.get("status", {})
            done = any(c.get("type") == "Complete" and c.get("status") == "True" for c in st.get("conditions", []))
            cells.append("Complete" if done else "Suspended" if obj.get("spec", {}).get("suspend") else "Running")
        elif rt.plural == "pods":
            cells.append(json_path_get(obj, ".status.phase") or "Pending")
        elif rt.plural == "events":
            ref = obj.get("involvedObject") or obj.get("regarding") or {}
            cells += [obj.get("type"), obj.get("reason"), f"{(ref.get('kind') or '').lower()}/{ref.get('name')}",
                      obj.get("message") or obj.get("note")]
        cells.append(human_age(meta.get("creationTimestamp")))
    row: Obj = {"cells": cells}
    if include == "Object":
        row["object"] = obj
    elif include != "None":
        row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta}
    return row


def table(rt: ResourceType, objs: list[Obj], include: str, resource_version: str, with_columns: bool = True) -> Obj:
    out: Obj = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
                "rows": [table_row(rt, o, include) for o in objs]}
    if with_columns:
        out["columnDefinitions"] = table_columns(rt)
    return out


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
        self._cel_cache: dict[str, Any] = {}

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
        import celpy

        errors: list[tuple[str, str]] = []
        if not isinstance(schema, dict) or value is None:
            return errors
        for rule in schema.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue  # transition rules need the old object; creation-time admission skips them
            prog = self._cel_cache.get(rule["rule"])
            if prog is None:
                env = celpy.Environment()
                prog = self._cel_cache[rule["rule"]] = env.program(env.compile(rule["rule"]))
            try:
                ok = bool(prog.evaluate({"self": celpy.json_to_cel(value)}))
            except Exception as exc:  # noqa: BLE001 - any evaluation error rejects, as in the API server
                errors.append((path.lstrip(".") or "<root>", f"CEL rule {rule['rule']!r} failed to evaluate: {exc}"))
                continue
            if not ok:
                errors.append((path.lstrip(".") or "<root>", rule.get("message") or f"failed rule: {rule['rule']}"))
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
                       f"are forbidden (changed: {', '.join(changed)})")
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
        strip = lambda s: {k: v for k, v in s.items() if k != "resources"}
        if strip(o) != strip(n):
            return [("spec", "Forbidden: spec is immutable after creation except resources.requests and volumeAttributesClassName")]
    return []
