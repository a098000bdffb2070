"""Pure pieces of Kubernetes API semantics for the strict emulator (kuberl.testing.kmock_strict): reading.

Resource types (built-in and from CRDs), API errors as metav1.Status, JSONPath-lite, label and field
selectors, and Table rendering of printer columns for kubectl. Writes (patches, server-side apply,
admission, immutability) are in kuberl.testing.kube_writes. No I/O, no event loop.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import Any

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


def invalid_options(kind: str, causes: list[tuple[str, str]]) -> ApiError:
    """A request's options refused (kube-apiserver: `PatchOptions.meta.k8s.io "" is invalid: ...`, 422)."""
    text = "; ".join(f"{f}: {m}" for f, m in causes)
    return ApiError(422, "Invalid", f'{kind}.meta.k8s.io "" is invalid: {text}',
                    {"group": "meta.k8s.io", "kind": kind,
                     "causes": [{"reason": "FieldValueRequired", "field": f, "message": m} for f, m in causes]})


APPLY_QUERY = "__apply__"  # set by the emulator on a server-side apply's query (never sent by a client)


def unknown_fields(rt: ResourceType, name: str, fields: list[str], apply: bool) -> ApiError:
    """fieldValidation=Strict and fields the schema does not declare, as kube-apiserver 1.35 answers: a create, update or
    patch fails decoding (400 BadRequest, every field named); a server-side apply fails building its typed patch (500,
    the first field, with a leading dot)."""
    if apply:
        return ApiError(500, "", f"failed to create typed patch object (/{name}; {rt.api_version}, Kind={rt.kind}): "
                        f".{fields[0].lstrip('.')}: field not declared in schema")
    named = ", ".join(f'unknown field "{f.lstrip(".")}"' for f in fields)
    version = rt.api_version.split("/")[-1]
    return ApiError(400, "BadRequest", f'{rt.kind} in version "{version}" cannot be handled as a {rt.kind}: strict decoding error: {named}')


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
# Discovery, OpenAPI stubs, Scale
# ---------------------------------------------------------------------------------------------

KUBE_VERSION = "1.32"


def discovery_document(types: list[ResourceType], path: str) -> Obj | None:
    """Discovery answers (/, /version, /api, /apis, /apis/{g}, /api/v1, /apis/{g}/{v}); None for other paths."""
    if path == "/":
        paths = {"/api", "/api/v1", "/apis", "/version", "/openapi/v3", "/healthz"}
        paths |= {f"/apis/{t.group}" for t in types if t.group} | {f"/apis/{t.group}/{t.version}" for t in types if t.group}
        return {"paths": sorted(paths)}
    if path == "/version":
        return {"major": "1", "minor": KUBE_VERSION.split(".")[1], "gitVersion": f"v{KUBE_VERSION}.0-kmock-strict",
                "platform": "linux/amd64", "goVersion": "go1.23", "compiler": "gc", "gitTreeState": "clean"}
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}
    groups: dict[str, list[str]] = {}
    for t in types:
        if t.group and t.version not in groups.setdefault(t.group, []):
            groups[t.group].append(t.version)

    def group_doc(g: str) -> Obj:
        versions = [{"groupVersion": f"{g}/{v}", "version": v} for v in groups[g]]
        return {"name": g, "versions": versions, "preferredVersion": versions[0]}

    if path == "/apis":
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in sorted(groups)]}
    m = re.match(r"^/apis/([^/]+)$", path)
    if m:
        if m.group(1) not in groups:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource (group {m.group(1)})")
        return {"kind": "APIGroup", "apiVersion": "v1", **group_doc(m.group(1))}
    m = re.match(r"^/(?:api/(v1)|apis/([^/]+)/([^/]+))$", path)
    if m:
        group, version = (m.group(2), m.group(3)) if m.group(2) else ("", "v1")
        served = [t for t in types if t.group == group and t.version == version]
        if not served:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}" if group else version,
                "resources": [r for t in served for r in t.discovery()]}
    return None

def openapi_v3_document(types: list[ResourceType], path: str) -> Obj:
    """Just enough OpenAPI v3 for kubectl to see that PATCH takes fieldValidation (server-side validation)."""
    gvs = sorted({(t.group, t.version) for t in types})
    if path == "/openapi/v3":
        return {"paths": {(f"apis/{g}/{v}" if g else "api/v1"): {"serverRelativeURL": f"/openapi/v3/{f'apis/{g}/{v}' if g else 'api/v1'}?hash=0"}
                          for g, v in gvs}}
    paths: Obj = {}
    for t in types:
        if (f"/openapi/v3/apis/{t.group}/{t.version}" if t.group else "/openapi/v3/api/v1") != path:
            continue
        prefix = f"/apis/{t.group}/{t.version}" if t.group else "/api/v1"
        url = f"{prefix}/namespaces/{{namespace}}/{t.plural}/{{name}}" if t.namespaced else f"{prefix}/{t.plural}/{{name}}"
        op = {"x-kubernetes-group-version-kind": {"group": t.group, "version": t.version, "kind": t.kind},
              "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
              "responses": {"200": {"description": "OK"}}}
        paths[url] = {"patch": op, "put": op}
    if not paths:
        raise ApiError(404, "NotFound", f"no OpenAPI document at {path}")
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": f"v{KUBE_VERSION}"}, "paths": paths, "components": {"schemas": {}}}


def scale_of(rt: ResourceType, obj: Obj) -> Obj:
    """The autoscaling/v1 Scale view of an object with a scale subresource."""
    assert rt.scale is not None
    meta = obj["metadata"]
    if rt.scale.label_selector:
        selector = json_path_get(obj, rt.scale.label_selector) or ""
    else:
        labels = json_path_get(obj, ".spec.selector.matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
            "spec": {"replicas": json_path_get(obj, rt.scale.spec_replicas) or 0},
            "status": {"replicas": json_path_get(obj, rt.scale.status_replicas) or 0, "selector": selector}}
