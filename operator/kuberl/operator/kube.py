"""The one module of the operator that talks to the Kubernetes API (async, aiohttp).

Called by kuberl.operator.handlers: server-side apply of children (field manager `kuberl-operator`),
reads of children, Nodes, Secrets, PVCs and pods, status and scale patches, deletes, and Events.
Credentials come from the pod's service account or the kubeconfig (via the `kubernetes` package's
loaders, which also refresh expiring tokens); everything else is plain HTTP against known paths.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp

FIELD_MANAGER = "kuberl-operator"
Obj = dict[str, Any]
log = logging.getLogger("kuberl.operator.kube")

# kind -> (apiVersion, plural, namespaced): every kind the operator reads or writes.
KINDS: dict[str, tuple[str, str, bool]] = {
    "ConfigMap": ("v1", "configmaps", True),
    "Secret": ("v1", "secrets", True),
    "Service": ("v1", "services", True),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims", True),
    "Pod": ("v1", "pods", True),
    "Event": ("v1", "events", True),
    "Node": ("v1", "nodes", False),
    "Lease": ("coordination.k8s.io/v1", "leases", True),  # leader election (kuberl.operator.leader)
    "Namespace": ("v1", "namespaces", False),
    "StorageClass": ("storage.k8s.io/v1", "storageclasses", False),  # why a PVC of ours stays Pending (observe.py)
    "StatefulSet": ("apps/v1", "statefulsets", True),
    "Deployment": ("apps/v1", "deployments", True),  # the tool sandbox (workflow.sandbox.placement pod)
    "Job": ("batch/v1", "jobs", True),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies", True),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets", True),
    "RLExperiment": ("kuberl.io/v1alpha1", "rlexperiments", True),
    # kuberl.operator.kueue; the version the installed Kueue serves replaces v1beta1 (kueue_status.api_version)
    "Workload": ("kueue.x-k8s.io/v1beta1", "workloads", True),
    "ResourceFlavor": ("kueue.x-k8s.io/v1beta1", "resourceflavors", False),
    "WorkloadPriorityClass": ("kueue.x-k8s.io/v1beta1", "workloadpriorityclasses", False),
}


def own_child(child: Obj, owner: Mapping[str, Any]) -> Obj:
    """Make `owner` the controller of `child` (ownerReference with blockOwnerDeletion), and nothing
    else: kopf.adopt would also copy the owner's labels, and a `kueue.x-k8s.io/queue-name` label on
    the RLExperiment would turn its trainer Job into a Kueue workload of its own."""
    meta = owner["metadata"]
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
           "controller": True, "blockOwnerDeletion": True}
    refs = [r for r in child["metadata"].get("ownerReferences") or [] if r.get("uid") != ref["uid"]]
    child["metadata"]["ownerReferences"] = [*refs, ref]
    return child


class KubeError(Exception):
    """A failed API call: HTTP status, the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = "",
                 causes: list[dict[str, Any]] | None = None):
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message
        self.causes = causes or []  # the Status's details.causes: {reason, message, field} per refused field

    @property
    def refused(self) -> bool:
        """The object was refused for what it says (not a server fault to retry): 400, 403, 422, or the 500 a server-side
        apply answers when the object has a field its schema does not declare ("failed to create typed patch object
        ... field not declared in schema": e.g. a misspelt field in an open podTemplate volume)."""
        return self.status in (400, 403, 422) or (self.status == 500 and "failed to create typed patch object" in (self.message or ""))


def path_for(kind: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None,
             api_version: str | None = None) -> str:
    """REST path of a kind (collection or object)."""
    if kind not in KINDS:
        raise ValueError(f"kuberl.operator.kube does not know kind {kind!r}; add it to KINDS")
    known_version, plural, namespaced = KINDS[kind]
    version = api_version or known_version
    base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
    if namespaced and namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if subresource:
        base += f"/{subresource}"
    return base


def _load_credentials() -> tuple[str, ssl.SSLContext | bool | None, Any]:
    """(host, TLS context, token function) from the pod's service account or the kubeconfig."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(client_configuration=cfg)
    ctx: ssl.SSLContext | bool | None = None
    if cfg.host.startswith("https"):
        if cfg.verify_ssl:
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
        else:
            ctx = False
        if cfg.cert_file and isinstance(ctx, ssl.SSLContext):
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)

    def token() -> str | None:
        if cfg.refresh_api_key_hook is not None:  # in-cluster: re-reads the rotated token
            cfg.refresh_api_key_hook(cfg)
        value = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if value and not value.lower().startswith("bearer "):
            value = f"Bearer {value}"
        return value

    return cfg.host, ctx, token


class KubeClient:
    """A small async Kubernetes client over one aiohttp session."""

    def __init__(self, host: str, *, token: str | None = None, ssl_context: ssl.SSLContext | bool | None = None,
                 refresh: Any = None, reload: Any = None, timeout: float = 30.0):
        self.host = host.rstrip("/")
        self._token, self._ssl, self._refresh, self._reload = token, ssl_context, refresh, reload
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster service account if present, else $KUBECONFIG / ~/.kube/config."""
        host, ctx, token = _load_credentials()
        return cls(host, ssl_context=ctx, refresh=token, reload=_load_credentials)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None,
                      content_type: str = "application/json", _retried: bool = False) -> Any:
        """One call; raises KubeError on a non-2xx answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {"Accept": "application/json"}
        auth = self._refresh() if self._refresh else self._token
        if auth:
            headers["Authorization"] = auth if auth.lower().startswith("bearer ") else f"Bearer {auth}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._session.request(method, self.host + path, params=params, data=data, headers=headers,
                                         ssl=self._ssl if self._ssl is not None else None) as resp:
            text = await resp.text()
            if resp.status == 401 and self._reload is not None and not _retried:
                # An expired token (kubeconfig exec plugins, e.g. EKS, give 15-minute tokens): reload once.
                _, _, self._refresh = self._reload()
                return await self.request(method, path, params=params, body=body, content_type=content_type, _retried=True)
            if resp.status >= 300:
                causes: list[dict[str, Any]] = []
                try:
                    status = json.loads(text)
                    reason, message = status.get("reason", ""), status.get("message", text)
                    causes = list((status.get("details") or {}).get("causes") or [])
                except (ValueError, AttributeError):
                    reason, message = resp.reason or "", text[:500]
                raise KubeError(resp.status, reason, message, method, path, causes)
            return json.loads(text) if text else None

    # ------------------------------------------------------------------ objects
    async def apply(self, obj: Obj, *, force: bool = True) -> Obj:
        """Server-side apply of a whole object with field manager kuberl-operator."""
        meta = obj["metadata"]
        path = path_for(obj["kind"], meta.get("namespace"), meta["name"], api_version=obj["apiVersion"])
        params = {"fieldManager": FIELD_MANAGER, "fieldValidation": "Strict"}
        if force:
            params["force"] = "true"
        return await self.request("PATCH", path, params=params, body=obj, content_type="application/apply-patch+yaml")

    async def create(self, obj: Obj, *, dry_run: bool = False) -> Obj:
        """POST a new object; `dry_run`: validated and admitted by the API server, then not stored (an existing name
        then answers 409 AlreadyExists, after validation: so a 409 says the object itself is valid)."""
        meta = obj["metadata"]
        path = path_for(obj["kind"], meta.get("namespace"), api_version=obj["apiVersion"])
        params = {"fieldManager": FIELD_MANAGER, "fieldValidation": "Strict"} | ({"dryRun": "All"} if dry_run else {})
        return await self.request("POST", path, params=params, body=obj)

    async def get(self, kind: str, namespace: str | None, name: str, subresource: str | None = None) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path_for(kind, namespace, name, subresource))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None = None, label_selector: str | None = None) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", path_for(kind, namespace), params=params)
        return list(result.get("items") or [])

    async def patch(self, kind: str, namespace: str | None, name: str, patch: Any, *, subresource: str | None = None,
                    json_patch: bool = False) -> Obj:
        ctype = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        return await self.request("PATCH", path_for(kind, namespace, name, subresource), body=patch, content_type=ctype)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        return await self.patch(kind, namespace, name, {"status": status}, subresource="status")

    async def delete(self, kind: str, namespace: str | None, name: str, *, propagation: str = "Background") -> bool:
        """Delete; False if it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        try:
            await self.request("DELETE", path_for(kind, namespace, name), body=body)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    # ------------------------------------------------------------------ questions the handlers ask
    async def secret_has_key(self, namespace: str, name: str, key: str) -> str | None:
        """None when the Secret holds the key; else what is missing (never the value)."""
        secret = await self.get("Secret", namespace, name)
        if secret is None:
            return f'Secret "{name}" not found in namespace {namespace}'
        if key not in (secret.get("data") or {}) and key not in (secret.get("stringData") or {}):
            return f'Secret "{name}" has no key "{key}"'
        return None

    async def pvc_exists(self, namespace: str, name: str) -> bool:
        return await self.get("PersistentVolumeClaim", namespace, name) is not None

    async def emit_event(self, involved: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on an object (kubectl describe shows it). Failures are logged, not raised."""
        meta = involved["metadata"]
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace") or "default"},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"), "name": meta["name"],
                               "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER, "reportingInstance": FIELD_MANAGER,
        }
        try:
            await self.request("POST", path_for("Event", event["metadata"]["namespace"]), body=event)
        except (TimeoutError, KubeError, aiohttp.ClientError) as exc:
            log.warning("could not post event %s on %s: %s", reason, meta["name"], exc)
