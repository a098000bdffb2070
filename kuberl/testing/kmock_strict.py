"""A strict Kubernetes API emulator on top of kmock (the kopf author's mock server), and a runner.

Stock kmock 0.8 keeps objects as plain dicts; kopf and kubectl need more of the API server's contract.
`StrictKubernetesEmulator` adds it: resourceVersion and generation, watches that replay from a
resourceVersion (subscribed before replaying), merge / strategic / JSON / server-side-apply patches
(422 on a failed JSON-patch `test`), status and scale subresources, finalizers and ownerReference
garbage collection, CRDs registered at run time and validated (schema, pruning, defaults, CEL),
built-in kinds validated with kubernetes-validate, Tables for `kubectl get` printer columns,
discovery with core groupVersion "v1", and the OpenAPI v3 stubs kubectl's field validation probes.
This module routes requests (paths, verbs, watches, patch bodies); the objects, events, admission and
deletion live in kuberl.testing.kube_store, the pure semantics in kube_semantics and kube_writes.
`EmulatorServer` runs it on a free loopback port in a background thread and writes a kubeconfig.
Used by tests/integration/test_operator*.py, e2e_tests/conftest.py and `python -m kuberl.testing.kmock_strict`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from kuberl.testing import kube_semantics as ks
from kuberl.testing import kube_writes as kw
from kuberl.testing.kube_semantics import ApiError, Obj, ResourceType
from kuberl.testing.kube_store import KubeObjectStore, Watcher, log


@attrs.define(kw_only=True)
class StrictKubernetesEmulator(KubeObjectStore):
    """kmock's KubernetesEmulator with the API server's contract (see the module docstring).

    Objects live in kmock's `objects` array (with history), so tests can assert on
    `emulator.objects['apps/v1/statefulsets', 'ns', 'name']`; kmock reactions added with
    `emulator[...] << ...` still win over the emulation (fault injection).
    """

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
        if method == "POST" and path in SELF_REVIEWS:
            return aiohttp.web.json_response(self_review(self._body(request)), status=201)
        rt, namespace, name, sub = self._route(method, path)
        return await self._serve_resource(request, method, rt, namespace, name, sub)

    def _route(self, method: str, path: str) -> tuple[ResourceType, str | None, str | None, str | None]:
        """A resource path's type, namespace, name and subresource (404 for what the server does not serve)."""
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
        return rt, namespace, name, sub

    async def _serve_resource(self, request: kmock.Request, method: str, rt: ResourceType, namespace: str | None,
                              name: str | None, sub: str | None) -> aiohttp.web.StreamResponse:
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

    def _select(self, rt: ResourceType, namespace: str | None, q: dict[str, str], copied: bool = True) -> list[Obj]:
        return [o for o in self.list_objects(rt.key, namespace, copied=copied)
                if ks.label_selector_matches(q.get("labelSelector"), o["metadata"].get("labels") or {})
                and ks.field_selector_matches(q.get("fieldSelector"), o)]

    def _list(self, rt: ResourceType, namespace: str | None, q: dict[str, str], accept: str) -> Obj:
        items = self._select(rt, namespace, q, copied=False)  # serialised at once by json_response, before any write
        if "as=Table" in accept:
            return ks.table(rt, items, q.get("includeObject", "Metadata"), str(self._rv))
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version, "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _watch(self, request: kmock.Request, rt: ResourceType, namespace: str | None, q: dict[str, str], accept: str) -> aiohttp.web.StreamResponse:
        watcher = Watcher(namespace, q.get("labelSelector"), q.get("fieldSelector"))
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
                try:  # JSON is YAML: the operator and kopf send JSON apply patches, which pure-Python YAML parses 50x slower
                    return json.loads(request.body)
                except ValueError:
                    return yaml.load(request.body, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            return json.loads(request.body)
        except (ValueError, yaml.YAMLError) as exc:
            raise ApiError(400, "BadRequest", f"the request body is not valid JSON/YAML: {exc}") from exc

    def _warnings(self, obj: Obj) -> dict[str, str]:
        unknown = obj.pop("__unknown__", None) if isinstance(obj, dict) else None
        return {"Warning": f'299 - "unknown field \\"{unknown[0]}\\""'} if unknown else {}

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
                raise ks.invalid_options("PatchOptions", [("fieldManager", "Required value: is required for apply patch")])
            q = {**q, ks.APPLY_QUERY: "1"}  # admission answers unknown fields as the real server's apply does
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

# The self-reviews a client asks about its own rights (kuberl.operator.access). The emulator authorizes every
# request, so it answers as an API server with --authorization-mode=AlwaysAllow does: everything, for the admin.
SELF_REVIEWS = ("/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                "/apis/authentication.k8s.io/v1/selfsubjectreviews")


def self_review(body: Obj) -> Obj:
    """The answer to a SelfSubjectRulesReview, SelfSubjectAccessReview or SelfSubjectReview: all allowed."""
    kind = (body or {}).get("kind", "")
    status: Obj = {"allowed": True}
    if kind == "SelfSubjectRulesReview":
        status = {"resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}],
                  "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}], "incomplete": False}
    elif kind == "SelfSubjectReview":
        status = {"userInfo": {"username": "kuberl-admin", "groups": ["system:masters", "system:authenticated"]}}
    return {**body, "status": status}


__all__ = ["EmulatorServer", "StrictKubernetesEmulator", "cpu_node", "default_crds", "kubeconfig", "load_crds", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
