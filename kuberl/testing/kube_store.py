"""The object store under the strict Kubernetes API emulator (kuberl.testing.kmock_strict): state without HTTP.

`KubeObjectStore` keeps the served resource types and the objects (in kmock's `objects` array, with
history), assigns resourceVersions and generations, logs events for watches, creates and updates objects
through admission (kuberl.testing.kube_writes.CrdAdmission for CRDs, kubernetes-validate for built-ins),
registers CRDs' types at run time, and deletes: finalizers, ownerReference garbage collection, namespace
and CRD cascades. `StrictKubernetesEmulator` (kmock_strict) serves it over the Kubernetes REST API.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import re
import secrets
import uuid
from typing import Any

import attrs
import kmock

from kuberl.testing import kube_semantics as ks
from kuberl.testing import kube_writes as kw
from kuberl.testing.kube_semantics import ApiError, Obj, ResourceType

log = logging.getLogger("kuberl.kmock_strict")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_ANNOTATIONS_BYTES = 262144  # apimachinery TotalAnnotationSizeLimitB: catches huge last-applied annotations
KUBE_VERSION = ks.KUBE_VERSION
CRD_KEY = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


class Watcher:
    def __init__(self, namespace: str | None, labels: str | None, fields: str | None):
        self.namespace, self.labels, self.fields = namespace, labels, fields
        self.queue: asyncio.Queue[tuple[int, str, Obj]] = asyncio.Queue()

    def wants(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return ks.label_selector_matches(self.labels, meta.get("labels") or {}) and ks.field_selector_matches(self.fields, obj)


@attrs.define(kw_only=True)
class KubeObjectStore(kmock.KubernetesEmulator):
    """Resource types, objects, events and the API server's write semantics; no request handling (see the module docstring)."""

    validate_builtins: bool = True  # reject built-in objects that kubernetes-validate rejects
    event_log_size: int = 5000  # per resource; older resourceVersions get 410 Gone, as from etcd compaction
    _types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _admission: dict[tuple[str, str, str], kw.CrdAdmission] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _log: dict[tuple[str, str, str], collections.deque] = attrs.field(factory=dict, init=False)
    _watchers: dict[tuple[str, str, str], set[Watcher]] = attrs.field(factory=dict, init=False)
    _uids: dict[str, tuple[tuple[str, str, str], str | None, str]] = attrs.field(factory=dict, init=False)
    # The keys of `objects` per resource (live or soft-deleted), so a LIST reads its own kind, not every object stored.
    _keys_by_type: dict[tuple[str, str, str], dict[tuple[Any, str | None, str], None]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        # No kmock fallbacks: every Kubernetes request is answered by StrictKubernetesEmulator._serve.
        for rt in ks.BUILTIN_RESOURCES:
            self._register(rt)

    # ------------------------------------------------------------------ state helpers
    def _register(self, rt: ResourceType) -> None:
        self._types[rt.key] = rt
        self._log.setdefault(rt.key, collections.deque(maxlen=self.event_log_size))
        self._watchers.setdefault(rt.key, set())
        if rt.crd is not None:
            schema = next((v.get("schema", {}).get("openAPIV3Schema") for v in rt.crd["spec"]["versions"] if v["name"] == rt.version), None)
            if schema:
                self._admission[rt.key] = kw.CrdAdmission(schema)
        self.resources[f"{rt.group}/{rt.version}/{rt.plural}" if rt.group else f"v1/{rt.plural}"] = kmock.ResourceInfo(
            kind=rt.kind, singular=rt.singular, namespaced=rt.namespaced, verbs=ks.VERBS,
            shortnames=rt.short_names, categories=rt.categories,
            subresources=[s for s, on in (("status", rt.status), ("scale", rt.scale)) if on])

    def _res(self, rt: ResourceType) -> kmock.resource:
        return kmock.resource(rt.group, rt.version, rt.plural)

    def get_object(self, rt_key: tuple[str, str, str], namespace: str | None, name: str) -> Obj | None:
        """The current object (a deep copy), or None."""
        key = (kmock.resource(*rt_key), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list_objects(self, rt_key: tuple[str, str, str], namespace: str | None = None, *, copied: bool = True) -> list[Obj]:
        """The live objects of one resource (in one namespace), sorted by namespace and name. copied=False
        hands out the stored dicts themselves: only for a caller that serialises them before the next write."""
        found = []
        for key in self._keys_by_type.get(rt_key, {}):
            o = self.objects[key]
            if not o.deleted and (namespace is None or key[1] == namespace):
                found.append((key[1] or "", key[2], o.raw))
        found.sort(key=lambda t: (t[0], t[1]))
        return [copy.deepcopy(raw) if copied else raw for _, _, raw in found]

    def _emit(self, rt: ResourceType, kind: str, obj: Obj) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._log[rt.key].append((self._rv, kind, copy.deepcopy(obj)))
        for w in list(self._watchers[rt.key]):
            if w.wants(obj):
                w.queue.put_nowait((self._rv, kind, copy.deepcopy(obj)))

    def _put(self, rt: ResourceType, obj: Obj, kind: str) -> Obj:
        meta = obj["metadata"]
        key = (self._res(rt), meta.get("namespace"), meta["name"])
        self._emit(rt, kind, obj)
        if key in self.objects:
            self.objects[key].history.append(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)
            self._keys_by_type.setdefault(rt.key, {})[key] = None
        self._uids[meta["uid"]] = (rt.key, meta.get("namespace"), meta["name"])
        return obj

    def _drop(self, rt: ResourceType, obj: Obj) -> None:
        """Remove for good: DELETED event, then the garbage collector's cascade and type removal."""
        meta = obj["metadata"]
        self.objects[self._res(rt), meta.get("namespace"), meta["name"]].delete()
        self._uids.pop(meta["uid"], None)
        self._emit(rt, "DELETED", obj)
        if rt.key == ("", "v1", "namespaces"):
            for other in list(self._types.values()):
                if other.namespaced:
                    for child in self.list_objects(other.key, meta["name"]):
                        self._delete_object(other, child, "Background")
        if rt.key == CRD_KEY:
            for other in [t for t in self._types.values() if t.crd is not None and t.crd["metadata"]["name"] == meta["name"]]:
                for child in self.list_objects(other.key):
                    self._drop(other, child)
                del self._types[other.key]
                self._admission.pop(other.key, None)
        asyncio.get_running_loop().call_later(0.1, self._collect_garbage, meta["uid"])

    def _collect_garbage(self, owner_uid: str) -> None:
        """Delete dependents whose owners are all gone (the GC's background propagation)."""
        for (res, _ns, _name), o in list(self.objects.items()):
            if o.deleted:
                continue
            refs = o.raw.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs) and not any(r.get("uid") in self._uids for r in refs):
                rt = self._types.get((res.group, res.version, res.plural))
                if rt is not None:
                    self._delete_object(rt, copy.deepcopy(o.raw), "Background")

    def _delete_object(self, rt: ResourceType, obj: Obj, propagation: str) -> Obj:
        meta = obj["metadata"]
        if propagation == "Orphan":
            for (res, _ns, _name), o in list(self.objects.items()):
                refs = [] if o.deleted else o.raw.get("metadata", {}).get("ownerReferences") or []
                if any(r.get("uid") == meta["uid"] for r in refs):
                    dep = copy.deepcopy(o.raw)
                    dep["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != meta["uid"]]
                    self._put(self._types[(res.group, res.version, res.plural)], dep, "MODIFIED")
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = ks.now_rfc3339()
                meta["deletionGracePeriodSeconds"] = 0
                meta["generation"] = meta.get("generation", 1) + 1
                self._put(rt, obj, "MODIFIED")
            return obj
        self._drop(rt, obj)
        return obj

    # ------------------------------------------------------------------ admission and writes
    def _admit(self, rt: ResourceType, obj: Obj, q: dict[str, str]) -> Obj:
        """Validate like admission; returns the (pruned, defaulted) object."""
        name = obj.get("metadata", {}).get("name", "")
        strict = q.get("fieldValidation", "Warn") == "Strict"
        annotations = obj.get("metadata", {}).get("annotations") or {}
        size = sum(len(k) + len(str(v)) for k, v in annotations.items())
        if size > MAX_ANNOTATIONS_BYTES:
            raise ks.invalid(rt, name, [("metadata.annotations", f"Too long: must have at most {MAX_ANNOTATIONS_BYTES} bytes (got {size})")])
        for key, value in annotations.items():
            if not isinstance(value, str):
                raise ks.invalid(rt, name, [(f"metadata.annotations.{key}", f"must be a string, got {value!r}")])
        for key, value in (obj.get("metadata", {}).get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]?", value):
                raise ks.invalid(rt, name, [(f"metadata.labels.{key}", f"invalid label value {value!r}")])
        admission = self._admission.get(rt.key)
        if admission is not None:
            pruned, errors, unknown = admission.admit(obj, False)
            if strict and unknown:
                raise ks.unknown_fields(rt, name, unknown, q.get(ks.APPLY_QUERY) == "1")
            if errors:
                raise ks.invalid(rt, name, errors)
            if unknown:
                pruned["__unknown__"] = unknown
            return pruned
        if self.validate_builtins and rt.crd is None:
            import kubernetes_validate

            from kuberl.testing import builtin_schemas

            clean = {k: v for k, v in obj.items() if k != "status" or rt.status}
            try:  # kubernetes_validate.validate with its schemas and validators cached
                builtin_schemas.validate(clean, KUBE_VERSION, strict=strict)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in getattr(exc, "absolute_path", [])) or "<root>"
                raise ks.invalid(rt, name, [(where, exc.message)]) from None
            except kubernetes_validate.SchemaNotFoundError:
                pass
        if rt.kind == "Secret" and rt.crd is None and "stringData" in obj:
            obj = secret_string_data_merged(obj)
        return obj

    def _create(self, rt: ResourceType, namespace: str | None, body: Any, q: dict[str, str]) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the object must be a JSON object")
        body = {"apiVersion": rt.api_version, "kind": rt.kind, **body}  # the endpoint implies them when absent (kopf's events)
        if body.get("kind") != rt.kind or body.get("apiVersion") != rt.api_version:
            raise ApiError(400, "BadRequest", f"the API version in the data ({body.get('apiVersion')}) and kind "
                           f"({body.get('kind')}) do not match the endpoint {rt.api_version} {rt.kind}")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise ks.invalid(rt, "", [("metadata.name", "Required value: name or generateName is required")])
        if not DNS1123_SUBDOMAIN.match(name) or len(name) > 253:
            raise ks.invalid(rt, name, [("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist of "
                                                          "lower case alphanumeric characters, '-' or '.'")])
        if rt.namespaced:
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            namespace = namespace or meta.get("namespace")
            if not namespace:
                raise ApiError(400, "BadRequest", f"{rt.kind} is namespaced: a namespace is required")
            if self.get_object(("", "v1", "namespaces"), None, namespace) is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if self.get_object(rt.key, meta.get("namespace"), name) is not None:
            raise ApiError(409, "AlreadyExists", f'{rt.plural}{"." + rt.group if rt.group else ""} "{name}" already exists',
                           {"name": name, "group": rt.group, "kind": rt.plural})
        for fld in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds", "uid", "creationTimestamp"):
            meta.pop(fld, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=ks.now_rfc3339(), generation=1)
        if rt.status:
            obj.pop("status", None)
        obj = self._admit(rt, obj, q)
        self._initial_status(rt, obj)
        if q.get("dryRun") == "All":
            return obj
        unknown = obj.pop("__unknown__", None)
        self._put(rt, obj, "ADDED")
        if rt.key == CRD_KEY:
            self._on_crd(obj)
        out = copy.deepcopy(obj)
        if unknown:
            out["__unknown__"] = unknown
        self._check_dangling_owners(rt, obj)
        return out

    def _check_dangling_owners(self, rt: ResourceType, obj: Obj) -> None:
        refs = obj["metadata"].get("ownerReferences") or []
        if refs and not any(r.get("uid") in self._uids for r in refs):
            # A real GC deletes a dependent whose owners do not exist (wrong uid = children vanish).
            log.warning("%s %s has only dangling ownerReferences: the GC deletes it", rt.kind, obj["metadata"]["name"])
            asyncio.get_running_loop().call_later(0.5, self._collect_garbage, refs[0].get("uid"))

    def _initial_status(self, rt: ResourceType, obj: Obj) -> None:
        if rt.key == ("", "v1", "namespaces"):
            obj["status"] = {"phase": "Active"}
        elif rt.key == CRD_KEY:
            names = obj["spec"]["names"]
            obj["status"] = {"acceptedNames": names, "storedVersions": [v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
                             "conditions": [{"type": t, "status": "True", "reason": r, "message": "", "lastTransitionTime": ks.now_rfc3339()}
                                            for t, r in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))]}

    def _on_crd(self, crd: Obj) -> None:
        for old in [t for t in self._types.values() if t.crd is not None and t.crd["metadata"]["name"] == crd["metadata"]["name"]]:
            self._types.pop(old.key, None)
        for rt in ks.resource_from_crd(crd):
            self._register(rt)

    def _conflict(self, rt: ResourceType, name: str) -> ApiError:
        return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.plural}{"." + rt.group if rt.group else ""} '
                        f'"{name}": the object has been modified; please apply your changes to the latest version and try again',
                        {"name": name, "group": rt.group, "kind": rt.plural})

    def _commit(self, rt: ResourceType, existing: Obj, new: Obj, sub: str | None, q: dict[str, str]) -> Obj:
        """Finish an update: subresource isolation, immutable metadata, admission, generation, events."""
        if sub == "status":
            result = copy.deepcopy(existing)
            if "status" in new:
                result["status"] = copy.deepcopy(new["status"])
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(new)
            if rt.status:
                if "status" in existing:
                    result["status"] = copy.deepcopy(existing["status"])
                else:
                    result.pop("status", None)
        result["apiVersion"], result["kind"] = rt.api_version, rt.kind
        meta, old = result.setdefault("metadata", {}), existing["metadata"]
        for fld in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            if fld in old:
                meta[fld] = old[fld]
            else:
                meta.pop(fld, None)
        if (sub == "status" or "managedFields" not in meta) and "managedFields" in old:
            meta["managedFields"] = old["managedFields"]
        meta["resourceVersion"] = old["resourceVersion"]
        result = self._admit(rt, result, q)
        unknown = result.pop("__unknown__", None)
        if sub != "status" and rt.crd is None:
            violations = kw.immutable_violations(rt.plural, existing, result)
            if violations:
                raise ks.invalid(rt, meta["name"], violations)
        if result == existing:
            return existing  # a no-op write changes nothing, not even resourceVersion (kopf relies on it)

        def body_of(o: Obj) -> Obj:
            return {k: v for k, v in o.items() if k not in ("metadata", "status")}

        if body_of(result) != body_of(existing):
            meta["generation"] = old.get("generation", 1) + 1
        if q.get("dryRun") == "All":
            return result
        if rt.key == CRD_KEY:
            self._initial_status(rt, result)
        self._put(rt, result, "MODIFIED")
        if rt.key == CRD_KEY:
            self._on_crd(result)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._drop(rt, result)
        out = copy.deepcopy(result)
        if unknown:
            out["__unknown__"] = unknown
        return out

    # ------------------------------------------------------------------ seeding (thread-unsafe: call in the loop)
    def seed(self, manifest: Obj, status: Obj | None = None) -> Obj:
        """Create an object directly (as if applied), optionally with a status: namespaces, nodes, CRDs."""
        api, kind = manifest["apiVersion"], manifest["kind"]
        rt = next((t for t in self._types.values() if t.api_version == api and t.kind == kind), None)
        if rt is None:
            raise ValueError(f"the emulator serves no {api} {kind}")
        obj = self._create(rt, manifest.get("metadata", {}).get("namespace"), manifest, {"fieldValidation": "Strict"})
        if status is not None:
            updated = copy.deepcopy(obj)
            updated["status"] = status
            obj = self._commit(rt, obj, updated, "status", {})
        return obj


def secret_string_data_merged(obj: Obj) -> Obj:
    """What the API server stores for a Secret: `stringData` is write-only, merged into `data` (base64, winning
    over a `data` key of the same name) and never returned."""
    import base64

    merged = {k: v for k, v in obj.items() if k != "stringData"}
    data = dict(obj.get("data") or {})
    for key, value in (obj.get("stringData") or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    merged["data"] = data
    return merged
