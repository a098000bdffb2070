"""A strict Kubernetes API emulator on top of kmock (the kopf author's mock server), and a runner.

Stock kmock 0.8 keeps objects as plain dicts; kopf and kubectl need more of the API server's contract.
`StrictKubernetesEmulator` adds it: resourceVersion and generation, watches that replay from a
resourceVersion (subscribed before replaying), merge / strategic / JSON / server-side-apply patches
(422 on a failed JSON-patch `test`), status and scale subresources, finalizers and ownerReference
garbage collection, CRDs registered at run time and validated (schema, pruning, defaults, CEL),
built-in kinds validated with kubernetes-validate, Tables for `kubectl get` printer columns,
discovery with core groupVersion "v1", and the OpenAPI v3 stubs kubectl's field validation probes.
`EmulatorServer` runs it on a free loopback port in a background thread and writes a kubeconfig.
Used by tests/integration/test_operator*.py, e2e_tests/conftest.py and `python -m kuberl.testing.kmock_strict`.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import logging
import re
import secrets
import uuid
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from kuberl.testing import kube_semantics as ks
from kuberl.testing import kube_writes as kw
from kuberl.testing.kube_semantics import ApiError, Obj, ResourceType

log = logging.getLogger("kuberl.kmock_strict")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_ANNOTATIONS_BYTES = 262144  # apimachinery TotalAnnotationSizeLimitB: catches huge last-applied annotations
KUBE_VERSION = ks.KUBE_VERSION
CRD_KEY = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


class _Watcher:
    def __init__(self, namespace: str | None, labels: str | None, fields: str | None):
        self.namespace, self.labels, self.fields = namespace, labels, fields
        self.queue: asyncio.Queue[tuple[int, str, Obj]] = asyncio.Queue()

    def wants(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return ks.label_selector_matches(self.labels, meta.get("labels") or {}) and ks.field_selector_matches(self.fields, obj)


@attrs.define(kw_only=True)
class StrictKubernetesEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the API server's contract (see the module docstring).

    Objects live in kmock's `objects` array (with history), so tests can assert on
    `emulator.objects['apps/v1/statefulsets', 'ns', 'name']`; kmock reactions added with
    `emulator[...] << ...` still win over the emulation (fault injection).
    """

    validate_builtins: bool = True  # reject built-in objects that kubernetes-validate rejects
    event_log_size: int = 5000  # per resource; older resourceVersions get 410 Gone, as from etcd compaction
    _types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _admission: dict[tuple[str, str, str], kw.CrdAdmission] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _log: dict[tuple[str, str, str], collections.deque] = attrs.field(factory=dict, init=False)
    _watchers: dict[tuple[str, str, str], set[_Watcher]] = attrs.field(factory=dict, init=False)
    _uids: dict[str, tuple[tuple[str, str, str], str | None, str]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        # No kmock fallbacks: every Kubernetes request is answered by _serve below.
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

    def list_objects(self, rt_key: tuple[str, str, str], namespace: str | None = None) -> list[Obj]:
        res = kmock.resource(*rt_key)
        out = [copy.deepcopy(o.raw) for (r, ns, _), o in self.objects.items()
               if r == res and not o.deleted and (namespace is None or ns == namespace)]
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

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

    # ------------------------------------------------------------------ request entry
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw_request.read()
        try:
            request = await kmock.Request._parse(raw_request, id=len(self._requests))
        except ValueError:  # kmock 0.8 cannot parse some paths (GET /api/v1/namespaces): serve it as plain HTTP
            request = kmock.Request(id=len(self._requests), raw_request=raw_request, url=raw_request.url,
                                    method=raw_request.method, params=dict(raw_request.query),
                                    headers=dict(raw_request.headers), body=body, text=body.decode(errors="replace"))
        self._requests.append(request)
        if len(self._requests) > 20000:  # a long e2e session must not grow without bound
            del self._requests[:10000]
        return await self._handle(request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._payloads:  # user reactions (fault injection) win over the emulation
            try:
                return await kmock.RawHandler._handle(self, request)
            except NotImplementedError:
                pass
        try:
            return await self._serve(request)
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)
        except Exception as exc:  # a bug here must reach the client as a 500, and the log
            log.exception("emulator failure on %s %s", request.method, request.url)
            return aiohttp.web.json_response(ApiError(500, "InternalError", repr(exc)).status(), status=500)

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            simple = ks.discovery_document(list(self._types.values()), path)
            if simple is not None:
                return aiohttp.web.json_response(simple)
            if path.startswith("/openapi/v3"):
                return aiohttp.web.json_response(ks.openapi_v3_document(list(self._types.values()), path))
            if path in ("/healthz", "/livez", "/readyz"):
                return aiohttp.web.Response(text="ok")
        m = re.match(r"^/(?:api/(v1)|apis/([^/]+)/([^/]+))/(.+)$", path)
        if not m:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({method} {path})")
        group, version = (m.group(2), m.group(3)) if m.group(2) else ("", "v1")
        parts = m.group(4).split("/")
        namespace = None
        if parts[0] == "namespaces" and len(parts) >= 3 and parts[2] not in ("status", "finalize"):
            namespace, parts = parts[1], parts[2:]
        rt = self._types.get((group, version, parts[0]))
        if rt is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{version}/{parts[0]})")
        name = parts[1] if len(parts) > 1 else None
        sub = "/".join(parts[2:]) or None
        if sub not in (None, "status", "scale") or (sub == "status" and not rt.status) or (sub == "scale" and not rt.scale):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({rt.plural}/{sub})")
        if rt.namespaced is False:
            namespace = None
        q = dict(request.params)
        accept = request.headers.get("Accept", "")
        if method == "GET" and name is None:
            if q.get("watch") in ("true", "1"):
                return await self._watch(request, rt, namespace, q, accept)
            return aiohttp.web.json_response(self._list(rt, namespace, q, accept))
        if method == "GET" and q.get("watch") in ("true", "1"):
            q["fieldSelector"] = ",".join(filter(None, [q.get("fieldSelector"), f"metadata.name={name}"]))
            return await self._watch(request, rt, namespace, q, accept)
        if method == "POST" and name is None:
            body = self._body(request)
            obj = self._create(rt, namespace, body, q)
            return aiohttp.web.json_response(obj, status=201, headers=self._warnings(obj))
        if name is None:
            if method == "DELETE":
                items = [o for o in self.list_objects(rt.key, namespace)
                         if ks.label_selector_matches(q.get("labelSelector"), o["metadata"].get("labels") or {})]
                for o in items:
                    self._delete_object(rt, o, "Background")
                return aiohttp.web.json_response({"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {}, "items": items})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if rt.namespaced and namespace is None:
            raise ApiError(404, "NotFound", f"{rt.plural} is namespaced: the path needs /namespaces/{{namespace}}/")
        if method == "GET":
            obj = self._must(rt, namespace, name)
            if sub is None and "as=Table" in accept:
                return aiohttp.web.json_response(ks.table(rt, [obj], q.get("includeObject", "Metadata"), str(self._rv)))
            return aiohttp.web.json_response(ks.scale_of(rt, obj) if sub == "scale" else obj)
        if method in ("PUT", "PATCH"):
            existed = self.get_object(rt.key, namespace, name) is not None
            obj = self._write(rt, namespace, name, sub, method, request, q)
            return aiohttp.web.json_response(obj, status=200 if existed else 201, headers=self._warnings(obj))
        if method == "DELETE":
            obj = self._must(rt, namespace, name)
            opts = self._body(request, allow_empty=True) or {}
            pre = opts.get("preconditions") or {}
            for fld in ("uid", "resourceVersion"):
                if pre.get(fld) and pre[fld] != obj["metadata"].get(fld):
                    raise ApiError(409, "Conflict", f"Precondition failed: {fld} in precondition: {pre[fld]}, "
                                   f"{fld} in object meta: {obj['metadata'].get(fld)}")
            propagation = opts.get("propagationPolicy") or q.get("propagationPolicy") or "Background"
            if q.get("dryRun") == "All" or opts.get("dryRun") == ["All"]:
                return aiohttp.web.json_response(obj)
            return aiohttp.web.json_response(self._delete_object(rt, obj, propagation))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    # ------------------------------------------------------------------ discovery
    # ------------------------------------------------------------------ reading
    def _must(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self.get_object(rt.key, namespace, name)
        if obj is None:
            raise ks.not_found(rt, name)
        return obj

    def _select(self, rt: ResourceType, namespace: str | None, q: dict[str, str]) -> list[Obj]:
        return [o for o in self.list_objects(rt.key, namespace)
                if ks.label_selector_matches(q.get("labelSelector"), o["metadata"].get("labels") or {})
                and ks.field_selector_matches(q.get("fieldSelector"), o)]

    def _list(self, rt: ResourceType, namespace: str | None, q: dict[str, str], accept: str) -> Obj:
        items = self._select(rt, namespace, q)
        if "as=Table" in accept:
            return ks.table(rt, items, q.get("includeObject", "Metadata"), str(self._rv))
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _watch(self, request: kmock.Request, rt: ResourceType, namespace: str | None, q: dict[str, str], accept: str) -> aiohttp.web.StreamResponse:
        watcher = _Watcher(namespace, q.get("labelSelector"), q.get("fieldSelector"))
        # Subscribe first, then replay: nothing that happens in between can be lost.
        self._watchers[rt.key].add(watcher)
        try:
            rv = q.get("resourceVersion") or ""
            backlog: list[tuple[int, str, Obj]] = []
            expired = False
            if rv in ("", "0"):
                backlog = [(self._rv, "ADDED", o) for o in self._select(rt, namespace, q)]
            else:
                since = int(rv) if rv.isdigit() else -1
                entries = list(self._log[rt.key])
                oldest = entries[0][0] if entries else self._rv + 1
                if since < 0 or (len(entries) == self._log[rt.key].maxlen and since < oldest - 1):
                    expired = True
                backlog = [(n, k, o) for n, k, o in entries if n > since and watcher.wants(o)]
            # Events already queued for this watcher are in the backlog too: skip them by rv.
            seen_up_to = self._rv
            resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request._raw_request)
            table = "as=Table" in accept
            first = [True]

            async def send(kind: str, obj: Obj) -> None:
                if table and kind in ("ADDED", "MODIFIED", "DELETED"):
                    obj = ks.table(rt, [obj], q.get("includeObject", "Metadata"), obj["metadata"]["resourceVersion"], first[0])
                    first[0] = False
                await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

            if expired:
                await send("ERROR", ApiError(410, "Expired", f"too old resource version: {rv} ({self._rv})").status())
                return resp
            for _, kind, obj in backlog:
                await send(kind, obj)
            timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
            deadline = asyncio.get_running_loop().time() + timeout if timeout else None
            bookmarks = q.get("allowWatchBookmarks") == "true"
            while True:
                remaining = deadline - asyncio.get_running_loop().time() if deadline else 30.0
                if remaining <= 0:
                    break
                try:
                    n, kind, obj = await asyncio.wait_for(watcher.queue.get(), timeout=min(remaining, 30.0))
                except TimeoutError:
                    if bookmarks:
                        await send("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": {"resourceVersion": str(self._rv)}})
                    continue
                if n <= seen_up_to:
                    continue
                await send(kind, obj)
            await resp.write_eof()
            return resp
        finally:
            self._watchers[rt.key].discard(watcher)

    # ------------------------------------------------------------------ writing
    @staticmethod
    def _body(request: kmock.Request, allow_empty: bool = False) -> Any:
        if not request.body:
            if allow_empty:
                return None
            raise ApiError(400, "BadRequest", "the request has no body")
        ctype = request.headers.get("Content-Type", "")
        if "protobuf" in ctype:
            raise ApiError(415, "UnsupportedMediaType", f"the emulator speaks JSON only, not {ctype}")
        try:
            if "yaml" in ctype:
                return yaml.safe_load(request.body)
            return json.loads(request.body)
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError(400, "BadRequest", f"the request body is not valid JSON/YAML: {exc}") from exc

    def _warnings(self, obj: Obj) -> dict[str, str]:
        unknown = obj.pop("__unknown__", None) if isinstance(obj, dict) else None
        return {"Warning": f'299 - "unknown field \\"{unknown[0]}\\""'} if unknown else {}

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
            pruned, errors, unknown = admission.admit(obj, strict)
            if errors:
                raise ks.invalid(rt, name, errors)
            if unknown:
                pruned["__unknown__"] = unknown
            return pruned
        if self.validate_builtins and rt.crd is None:
            import kubernetes_validate

            clean = {k: v for k, v in obj.items() if k != "status" or rt.status}
            try:
                kubernetes_validate.validate(clean, KUBE_VERSION, strict=strict)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in getattr(exc, "absolute_path", [])) or "<root>"
                raise ks.invalid(rt, name, [(where, exc.message)]) from None
            except kubernetes_validate.SchemaNotFoundError:
                pass
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

    def _write(self, rt: ResourceType, namespace: str | None, name: str, sub: str | None, method: str,
               request: kmock.Request, q: dict[str, str]) -> Obj:
        ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip()
        existing = self.get_object(rt.key, namespace, name)
        if existing is None and not (method == "PATCH" and ctype == "application/apply-patch+yaml" and sub is None):
            raise ks.not_found(rt, name)
        body = self._body(request)
        if ctype == "application/apply-patch+yaml":
            manager = q.get("fieldManager")
            if not manager:
                raise ApiError(400, "BadRequest", "fieldManager is required for apply requests")
            if not isinstance(body, dict) or body.get("kind") != rt.kind or body.get("apiVersion") != rt.api_version:
                raise ApiError(400, "BadRequest", f"an apply patch must name apiVersion {rt.api_version} and kind {rt.kind}")
            if body.get("metadata", {}).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "the name of the object does not match the name in the URL")
            if existing is None:
                body.setdefault("metadata", {})["name"] = name
                created = self._create(rt, namespace, kw.server_side_apply(None, body, manager), q)
                return created
        if sub == "scale":
            scale = ks.scale_of(rt, existing)
            if method == "PUT":
                new_scale = body
            elif ctype == "application/json-patch+json":
                new_scale = kw.json_patch(scale, body)
            else:
                new_scale = kw.merge_patch(scale, body)
            replicas = (new_scale.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                raise ks.invalid(rt, name, [("spec.replicas", f"Invalid value: {replicas!r}: must be a non-negative integer")])
            want_rv = (new_scale.get("metadata") or {}).get("resourceVersion")
            if method == "PUT" and want_rv and want_rv != existing["metadata"]["resourceVersion"]:
                raise self._conflict(rt, name)
            new = copy.deepcopy(existing)
            ks.json_path_set(new, rt.scale.spec_replicas, replicas)
            return ks.scale_of(rt, self._commit(rt, existing, new, None, q))
        if method == "PUT":
            new = body
            want_rv = (new.get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != existing["metadata"]["resourceVersion"]:
                raise self._conflict(rt, name)
            if not want_rv and rt.crd is not None:
                raise ks.invalid(rt, name, [("metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update")])
        elif ctype == "application/merge-patch+json":
            new = kw.merge_patch(existing, body)
        elif ctype == "application/strategic-merge-patch+json":
            if rt.crd is not None:
                raise ApiError(415, "UnsupportedMediaType", "strategic merge patch is not supported for custom resources: use a merge or JSON patch")
            new = kw.strategic_merge_patch(existing, body)
        elif ctype == "application/json-patch+json":
            new = kw.json_patch(existing, body)
        elif ctype == "application/apply-patch+yaml":
            new = kw.server_side_apply(existing, body, q["fieldManager"])
            if sub != "status" and rt.status:
                new["status"] = existing.get("status")
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patched object is not a JSON object")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if method == "PATCH" and want_rv and want_rv != existing["metadata"]["resourceVersion"]:
            raise self._conflict(rt, name)
        return self._commit(rt, existing, new, sub, q)

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


# The runner lives in kuberl.testing.emulator_server (it imports this module lazily); re-exported here
# so `from kuberl.testing.kmock_strict import EmulatorServer` and `python -m kuberl.testing.kmock_strict` work.
from kuberl.testing.emulator_server import (  # noqa: E402 - after the class: emulator_server imports this module
    EmulatorServer,
    cpu_node,
    default_crds,
    kubeconfig,
    load_crds,
    main,
)

__all__ = ["EmulatorServer", "StrictKubernetesEmulator", "cpu_node", "default_crds", "kubeconfig", "load_crds", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
