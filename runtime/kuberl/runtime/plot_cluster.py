"""`kuberl plot <experiment>`: a cluster run's whole curve, read from the metrics stream on its bus.

Steps: read the RLExperiment with the `kubernetes` client (the kubeconfig and context kubectl would
use, or --kubeconfig/--context; in a pod, its service account); find its bus: `spec.bus.external.url`
with the token in its `credentialsSecret`, or the embedded NATS Service reached through `kubectl
port-forward` on a local port kubectl picks (the operator's read-only bus user when the bus Secret has
one, else the bus token); then read the stream `kuberl.runtime.bus.metrics.read_rows` describes.
The bus names carry the experiment's run (annotation kuberl.io/bus-run, else `<namespace>.<uid[:12]>`),
as the operator sets $KUBERL_BUS_RUN in the pods (kuberl.operator.naming.bus_run).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kuberl.runtime.bus.connection import redact
from kuberl.runtime.bus.metrics import MetricsError, read_rows
from kuberl.runtime.bus.names import BusNames

GROUP, VERSION, PLURAL = "kuberl.io", "v1alpha1", "rlexperiments"
BUS_RUN_ANNOTATION = "kuberl.io/bus-run"  # kuberl.operator.naming.BUS_RUN_ANNOTATION
BUS_CLIENT_PORT = 4222  # kuberl.operator.naming.BUS_CLIENT_PORT
STATEFULSET_NAME_MAX = 52  # the embedded bus's StatefulSet and client Service (kuberl.operator.naming.bus_name)
OBJECT_NAME_MAX = 253
READER_USER, READER_PASSWORD_KEY = "operator", "operator-password"  # the embedded bus's read-only user, where it has users
FORWARDING = re.compile(r"Forwarding from (?:127\.0\.0\.1|\[::1\]):(\d+) ->")


class ClusterError(Exception):
    """Reading a cluster run's metrics failed: the message says what and what to do."""


# -- names and commands (pure) --------------------------------------------------------------------


def child_name(experiment: str, suffix: str, limit: int) -> str:
    """`{exp}-{suffix}`, cut with a 5-character hash when too long (kuberl.operator.naming._child)."""
    full = f"{experiment}-{suffix}"
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(experiment.encode()).hexdigest()[:5]
    keep = limit - len(suffix) - len(digest) - 2
    return f"{experiment[:keep].rstrip('-')}-{digest}-{suffix}"


def bus_run(exp: dict[str, Any]) -> str:
    """The run in the experiment's bus names: the pinned annotation, else `<namespace>.<uid[:12]>`."""
    meta = exp.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if BUS_RUN_ANNOTATION in annotations:
        return str(annotations[BUS_RUN_ANNOTATION])
    uid = str(meta.get("uid") or "").replace("-", "").lower()
    return f"{meta.get('namespace')}.{uid[:12]}" if uid else ""


@dataclass(frozen=True)
class BusEndpoint:
    """Where an experiment's bus is: an external URL, or the embedded bus's Service; and its credentials Secret."""

    url: str | None  # external
    service: str | None  # embedded: reached through kubectl port-forward
    secret: str | None  # Secret with the credentials (None: no auth)
    key: str | None  # its key holding the token (embedded: the reader password is preferred when present)


def bus_endpoint(exp: dict[str, Any]) -> BusEndpoint:
    name = exp["metadata"]["name"]
    bus = ((exp.get("spec") or {}).get("bus") or {})
    external = bus.get("external")
    if external:
        ref = external.get("credentialsSecret") or {}
        return BusEndpoint(str(external["url"]), None, ref.get("name"), (ref.get("key") or "token") if ref else None)
    return BusEndpoint(None, child_name(name, "bus", STATEFULSET_NAME_MAX), child_name(name, "bus-credentials", OBJECT_NAME_MAX), "token")


def port_forward_command(namespace: str, service: str, *, kubeconfig: str | None = None, context: str | None = None,
                         kubectl: str = "kubectl", port: int = BUS_CLIENT_PORT) -> list[str]:
    """The kubectl command that forwards a free local port (kubectl picks it) to the bus Service."""
    return [kubectl, *(["--kubeconfig", kubeconfig] if kubeconfig else []), *(["--context", context] if context else []),
            "port-forward", "--namespace", namespace, "--address", "127.0.0.1", f"service/{service}", f":{port}"]


def forwarded_port(line: str) -> int | None:
    """The local port of a `kubectl port-forward` output line ("Forwarding from 127.0.0.1:53121 -> 4222")."""
    m = FORWARDING.search(line)
    return int(m.group(1)) if m else None


# -- the Kubernetes API ----------------------------------------------------------------------------


def _api_client(kubeconfig: str | None, context: str | None) -> Any:
    try:
        from kubernetes import config
    except ModuleNotFoundError:
        raise ClusterError("the `kubernetes` package is missing: pip install kubernetes") from None
    try:
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    except config.ConfigException as exc:
        if kubeconfig or context:
            raise ClusterError(f"kubeconfig {kubeconfig or '(default)'}{f', context {context}' if context else ''}: {exc}") from None
        try:  # inside a pod: its service account
            config.load_incluster_config()
        except config.ConfigException:
            raise ClusterError(f"no kubeconfig ({exc}): pass --kubeconfig, set KUBECONFIG, or run where ~/.kube/config is") from None
        from kubernetes import client

        return client.ApiClient()


def _call(what: str, host: str, fn: Any, *args: Any) -> Any:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args, _request_timeout=20)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise ClusterError(f"{what}: the API server at {host} answered {exc.status} {exc.reason}") from None
    except (HTTPError, OSError) as exc:
        raise ClusterError(f"{what}: cannot reach the Kubernetes API at {host} ({type(exc).__name__})") from None


def read_experiment(name: str, namespace: str, kubeconfig: str | None, context: str | None) -> tuple[dict[str, Any], Any]:
    """The RLExperiment object and the API client; ClusterError when it does not exist."""
    from kubernetes import client

    api = _api_client(kubeconfig, context)
    api.configuration.retries = 1
    host = api.configuration.host
    custom = client.CustomObjectsApi(api)
    exp = _call(f"read RLExperiment {namespace}/{name}", host, custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
    if exp is None:
        raise ClusterError(f"RLExperiment {name!r} not found in namespace {namespace!r} (at {host}): "
                           "check the name and --namespace (kubectl get rlx -A lists them)")
    return exp, api


def read_credentials(api: Any, namespace: str, endpoint: BusEndpoint) -> dict[str, str]:
    """nats.connect's auth arguments: {} (no Secret), {"token": ...} or {"user": ..., "password": ...}."""
    from kubernetes import client

    if endpoint.secret is None:
        return {}
    core = client.CoreV1Api(api)
    what = f"read Secret {namespace}/{endpoint.secret}"
    secret = _call(what, api.configuration.host, core.read_namespaced_secret, endpoint.secret, namespace)
    if secret is None:
        raise ClusterError(f"{what}: not found (the bus credentials)")
    data = secret.data or {}
    if endpoint.service is not None and READER_PASSWORD_KEY in data:  # the embedded bus with one user per role
        return {"user": READER_USER, "password": base64.b64decode(data[READER_PASSWORD_KEY]).decode()}
    if endpoint.key not in data:
        raise ClusterError(f"{what}: it has no key {endpoint.key!r} (keys: {', '.join(sorted(data)) or 'none'})")
    return {"token": base64.b64decode(data[endpoint.key]).decode().strip()}


# -- port-forward ----------------------------------------------------------------------------------


@contextmanager
def port_forward(cmd: list[str], timeout: float = 30.0) -> Iterator[int]:
    """Run `kubectl port-forward` until the block ends; yields the local port it listens on."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    found: list[int] = []
    errors: list[str] = []
    ready = threading.Event()

    def read(stream: Any, parse: bool) -> None:
        for line in stream:
            if not parse:
                errors.append(line.strip())
            elif (port := forwarded_port(line)) is not None and not found:
                found.append(port)
                ready.set()
        ready.set()  # the stream closed: kubectl exited

    threads = [threading.Thread(target=read, args=(proc.stdout, True), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, False), daemon=True)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + timeout
        while not found and proc.poll() is None and time.monotonic() < deadline:
            ready.wait(0.2)
        if not found:
            if proc.poll() is not None:
                threads[1].join(2.0)  # kubectl's last words
                why = errors[-1] if errors else f"exit code {proc.returncode}"
            else:
                why = f"no port after {timeout:.0f} s"
            raise ClusterError(f"{cmd[-2]}: kubectl port-forward failed: {why}")
        yield found[0]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- reading the stream -----------------------------------------------------------------------------


async def read_bus_rows(url: str, auth: dict[str, str], names: BusNames, connect_timeout: float = 10.0) -> list[dict[str, Any]]:
    import nats

    errors: list[BaseException] = []

    async def remember(exc: Exception) -> None:
        errors[:] = [exc]

    try:  # nats-py keeps trying a refused server: the deadline is ours
        nc = await asyncio.wait_for(nats.connect(url, connect_timeout=min(connect_timeout, 5.0), allow_reconnect=False,
                                                 max_reconnect_attempts=0, error_cb=remember, name="kuberl-plot", **auth),
                                    timeout=connect_timeout)
    except Exception as exc:  # noqa: BLE001 - nats-py raises many kinds; all mean 'not reachable'
        err = errors[-1] if errors else exc
        why = f"{type(err).__name__}: {err}" if str(err) else f"no answer in {connect_timeout:.0f} s"
        hint = ": check the token in the credentials Secret" if "authorization" in str(err).lower() else ""
        raise ClusterError(f"cannot reach the bus at {redact(url)} ({why}){hint}") from None
    try:
        return await read_rows(nc.jetstream(timeout=10.0), names)
    except MetricsError as exc:
        raise ClusterError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a refused or broken read: say which bus
        raise ClusterError(f"reading the metrics stream from {redact(url)} failed ({type(exc).__name__}: {exc})") from None
    finally:
        await nc.close()


def read_cluster_rows(name: str, namespace: str, kubeconfig: str | None = None, context: str | None = None) -> list[dict[str, Any]]:
    """Every step's metrics row of the cluster experiment `namespace/name`, from its bus."""
    exp, api = read_experiment(name, namespace, kubeconfig, context)
    endpoint = bus_endpoint(exp)
    auth = read_credentials(api, namespace, endpoint)
    names = BusNames.for_experiment(name, run=bus_run(exp))
    if endpoint.url is not None:
        return asyncio.run(read_bus_rows(endpoint.url, auth, names))
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ClusterError("kubectl is not on PATH: it is needed to port-forward to the experiment's embedded bus")
    with port_forward(port_forward_command(namespace, endpoint.service or "", kubeconfig=kubeconfig, context=context, kubectl=kubectl)) as port:
        return asyncio.run(read_bus_rows(f"nats://127.0.0.1:{port}", auth, names))
