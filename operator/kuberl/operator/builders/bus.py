"""The embedded trajectory bus: NATS JetStream StatefulSet, its Services and its credentials Secret.

Called by builders.build_children and the kopf handlers (O2). With spec.bus.external none of these
objects exist; pods then reach the external URL with the user's credentials Secret.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

from kubernetes.utils.quantity import parse_quantity

from kuberl.api.v1alpha1 import (
    AcceleratorSpec,
    AcceleratorType,
    EmbeddedBusSpec,
    RLExperiment,
)
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import bus_auth, pinning
from kuberl.operator.builders.common import (
    Obj,
    container_security_context,
    headless_service,
    metadata,
    pod_security_context,
    stable_hash,
    with_spec_hash,
)

DEFAULT_NATS_IMAGE = "nats:2.15-alpine"
# The NATS image of embedded buses without spec.bus.embedded.image. `kuberl operator` sets it once at
# start-up from $KUBERL_NATS_IMAGE (the chart's runtimeImages.nats, for mirrors and air-gapped
# clusters) through configure_nats_image(); pinned per experiment like every pod template.
NATS_IMAGE = DEFAULT_NATS_IMAGE


_IMAGE_REFERENCE = re.compile(r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]([-a-z0-9._]*[a-z0-9])?)*"
                              r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")


def configure_nats_image(image: str | None) -> str:
    """Set the default NATS image (None or "": nats:2.15-alpine); returns it. ValueError on a bad reference."""
    global NATS_IMAGE
    value = (image or "").strip()
    if value and not _IMAGE_REFERENCE.match(value):
        raise ValueError(f"NATS image {image!r} is no valid image reference (e.g. registry.example.com/mirror/nats:2.15-alpine)")
    NATS_IMAGE = value or DEFAULT_NATS_IMAGE
    return NATS_IMAGE
NATS_CONF_KEY = "nats.conf"
NATS_CONF_DIR = "/etc/nats"
JETSTREAM_DIR = "/data/jetstream"
# JetStream may fill this share of its volume; the rest is headroom for the file system and compaction.
JETSTREAM_STORE_SHARE = Decimal("0.9")
# NATS clients refuse payloads above 64 MiB; the server's own hard limit.
NATS_MAX_PAYLOAD_LIMIT = 64 * 1024 * 1024
LAME_DUCK_SECONDS = 30  # nats-server refuses less than 30 s
PID_DIR = "/var/run/nats"
PID_FILE = f"{PID_DIR}/nats.pid"  # the preStop hook signals lame-duck mode through it
# Requests when spec.bus.embedded.resources sets none: a NATS server with BestEffort QoS is the first
# pod evicted under node pressure, and the whole experiment waits on it. Limits stay the user's.
DEFAULT_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
HOSTNAME_KEY = "kubernetes.io/hostname"
ZONE_KEY = "topology.kubernetes.io/zone"


def cluster_placement(exp: RLExperiment) -> Obj:
    """A 3- or 5-server JetStream cluster keeps its quorum only if one node (or zone) going down takes
    at most a minority: spread the servers over nodes (preferred anti-affinity, so a small cluster
    still schedules them) and over zones where there are several. Nothing for a single server."""
    if _embedded(exp).replicas < 2:
        return {}
    selector = {"matchLabels": L.selector_labels(exp, L.Role.BUS)}
    return {
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": HOSTNAME_KEY, "labelSelector": selector}},
        ]}},
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": ZONE_KEY, "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": selector},
        ],
    }


def _embedded(exp: RLExperiment) -> EmbeddedBusSpec:
    if exp.spec.bus.embedded is None:
        raise ValueError(f"{exp.namespace}/{exp.name}: spec.bus.external is set; there is no embedded bus to build")
    return exp.spec.bus.embedded


def _bytes(value: int | str, path: str) -> int:
    try:
        return int(parse_quantity(value))
    except ValueError as exc:
        raise ValueError(f"{path}: {value!r} is not a Kubernetes quantity") from exc


def _quote(text: str) -> str:
    # NATS config strings accept JSON escapes; quoting keeps values like "12e5" or "-x" strings.
    return json.dumps(text)


def render_nats_conf(exp: RLExperiment, token: str) -> str:
    """nats.conf: client port, monitoring, max_payload, one user per role (bus_auth: trainer, rollout,
    operator, each with its subject permissions), JetStream storage, cluster routes (> 1 server).

    The server name comes from the command line (`--name $(POD_NAME)`): NATS's `$VAR` substitution
    parses values, and a pod name such as `12-bus-0` would not survive it.
    """
    bus = _embedded(exp)
    max_payload = _bytes(exp.spec.bus.max_payload, "spec.bus.maxPayload")
    if max_payload > NATS_MAX_PAYLOAD_LIMIT:
        raise ValueError(f"spec.bus.maxPayload: {exp.spec.bus.max_payload!r} is above NATS's 64Mi limit")
    store = int(_bytes(bus.storage, "spec.bus.embedded.storage") * JETSTREAM_STORE_SHARE)
    lines = [
        f"port: {naming.BUS_CLIENT_PORT}",
        f"http_port: {naming.BUS_MONITOR_PORT}",
        f"max_payload: {max_payload}",
        f"lame_duck_duration: \"{LAME_DUCK_SECONDS}s\"",
        f"pid_file: {_quote(PID_FILE)}",
        "authorization {",
        "  users = [",
        *(f"    {user_entry(exp, token, role)}" for role in bus_auth.ROLES),
        "  ]",
        "}",
        "jetstream {",
        f"  store_dir: {_quote(JETSTREAM_DIR)}",
        f"  max_file_store: {store}",
        "}",
    ]
    if bus.replicas > 1:
        headless = naming.bus_headless_name(exp)
        routes = [f"nats://{pod}.{headless}.{exp.namespace}.svc:{naming.BUS_CLUSTER_PORT}" for pod in naming.bus_pod_names(exp)]
        lines += [
            "cluster {",
            f"  name: {_quote(exp.name)}",
            f"  port: {naming.BUS_CLUSTER_PORT}",
            "  routes: [",
            *(f"    {_quote(r)}" for r in routes),
            "  ]",
            "}",
        ]
    return "\n".join(lines) + "\n"


def user_entry(exp: RLExperiment, token: str, role: str) -> str:
    """One `users` entry of nats.conf: the role's name, password and permissions (JSON, which NATS reads)."""
    entry = {"user": role, "password": bus_auth.role_password(token, role),
             "permissions": bus_auth.permissions(role, bus_auth.bus_objects(exp))}
    return json.dumps(entry, separators=(", ", ": "))


def build_bus_secret(exp: RLExperiment, token: str) -> Obj:
    """Secret `{exp}-bus-credentials`: `token` (the random secret the passwords derive from, read by the
    operator only), `{role}-password` for each role (each pod mounts its own key only) and `nats.conf`."""
    if not token or any(c.isspace() or c in "\"\\" for c in token):
        raise ValueError("bus token must be a non-empty string without whitespace, quotes or backslashes")
    passwords = {bus_auth.password_key(role): bus_auth.role_password(token, role) for role in bus_auth.ROLES}
    return pinning.stamp({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(exp, naming.bus_secret_name(exp), L.Component.BUS),
        "type": "Opaque",
        "stringData": {bus_auth.TOKEN_KEY: token, **passwords, NATS_CONF_KEY: render_nats_conf(exp, token)},
    }, exp)


def build_bus_users_secret(exp: RLExperiment, creds: dict[str, str]) -> Obj:
    """Secret `{exp}-bus-users` (a shared external NATS): `{role}.creds` for the trainer and the rollout, each
    a user minted for this experiment alone (kuberl.operator.nats_jwt); each pod reads its own key only."""
    missing = [role for role in (bus_auth.TRAINER, bus_auth.ROLLOUT) if not creds.get(role)]
    if missing:
        raise ValueError(f"bus users Secret: no credentials for {', '.join(missing)}")
    return pinning.stamp({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(exp, naming.bus_users_secret_name(exp), L.Component.BUS),
        "type": "Opaque",
        "stringData": {bus_auth.creds_key(role): creds[role] for role in (bus_auth.TRAINER, bus_auth.ROLLOUT)},
    }, exp)


def _probe(path: str, period: int, failures: int) -> Obj:
    return {
        "httpGet": {"path": path, "port": "monitor"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def build_bus_statefulset(exp: RLExperiment, finished: str | None = None) -> Obj:
    """NATS JetStream StatefulSet: 1, 3 or 5 servers, one PVC each, non-root, probed on /healthz.

    `finished` ("Succeeded" or "Failed": the experiment is over) releases what the bus holds: no servers, and after a
    success with bus.embedded.afterSuccess Delete its volumes too (the StatefulSet controller deletes the claims of the
    servers it scales away when whenScaled is Delete). A failure keeps the volumes, as a suspend does."""
    bus = _embedded(exp)
    name = naming.bus_name(exp)
    selector = L.selector_labels(exp, L.Role.BUS)
    # Hash nats.conf without the token: pods roll when the server config changes, and no secret
    # value (or a hash of it) reaches the StatefulSet.
    conf_hash = stable_hash(render_nats_conf(exp, "redacted"))
    container: Obj = {
        "name": "nats",
        "image": bus.image or NATS_IMAGE,
        "args": ["--config", f"{NATS_CONF_DIR}/{NATS_CONF_KEY}", "--name", "$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [
            {"name": "client", "containerPort": naming.BUS_CLIENT_PORT},
            {"name": "cluster", "containerPort": naming.BUS_CLUSTER_PORT},
            {"name": "monitor", "containerPort": naming.BUS_MONITOR_PORT},
        ],
        "volumeMounts": [
            {"name": "config", "mountPath": NATS_CONF_DIR, "readOnly": True},
            {"name": "data", "mountPath": "/data"},
            {"name": "pid", "mountPath": PID_DIR},
        ],
        # JetStream may take a while to recover its streams after a restart: startup gives it 5 min.
        "startupProbe": _probe("/healthz", 5, 60),
        "livenessProbe": _probe("/healthz?js-enabled-only=true", 30, 3),
        "readinessProbe": _probe("/healthz?js-enabled-only=true", 10, 3),
        # Lame-duck mode moves clients to the other servers before this one stops.
        "lifecycle": {"preStop": {"exec": {"command": ["nats-server", f"-sl=ldm={PID_FILE}"]}}},
        "securityContext": {**container_security_context(), "readOnlyRootFilesystem": True},
    }
    resources = {part: {k: str(v) for k, v in getattr(bus.resources, part).items()} for part in ("requests", "limits")}
    resources["requests"] = {**DEFAULT_REQUESTS, **resources["requests"]}
    for name, limit in resources["limits"].items():  # a limit below our default request would be refused
        if name in DEFAULT_REQUESTS and name not in bus.resources.requests:
            resources["requests"][name] = limit
    resources = {k: v for k, v in resources.items() if v}
    if resources:
        container["resources"] = resources
    keep = bus.after_success == "Keep" and finished == "Succeeded"
    release = finished == "Succeeded" and not keep
    pvc_spec: Obj = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": str(bus.storage)}}}
    if bus.storage_class_name:
        pvc_spec["storageClassName"] = bus.storage_class_name
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(exp, name, L.Component.BUS),
        "spec": {
            "replicas": 0 if exp.spec.suspend or (finished and not keep) else bus.replicas,
            "serviceName": naming.bus_headless_name(exp),
            # All servers start together: a JetStream cluster needs a quorum before any is healthy.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            # Deleting the experiment deletes the JetStream volumes; suspending (scale to 0) keeps them.
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete" if release else "Retain"},
            "template": {
                "metadata": {
                    "labels": L.child_labels(exp, L.Component.BUS),
                    "annotations": {L.BUS_CONFIG_HASH_ANNOTATION: conf_hash, L.DEFAULT_CONTAINER_ANNOTATION: "nats"},
                },
                "spec": {
                    "serviceAccountName": naming.service_account_name(exp),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": LAME_DUCK_SECONDS + 30,
                    "securityContext": pod_security_context(AcceleratorSpec(type=AcceleratorType.CPU, count=0)),
                    **cluster_placement(exp),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "config",
                            "secret": {"secretName": naming.bus_secret_name(exp), "items": [{"key": NATS_CONF_KEY, "path": NATS_CONF_KEY}]},
                        },
                        {"name": "pid", "emptyDir": {}},
                    ],
                },
            },
            "volumeClaimTemplates": [
                {"metadata": {"name": "data", "labels": L.child_labels(exp, L.Component.BUS)}, "spec": pvc_spec}
            ],
        },
    }
    return with_spec_hash(pinning.stamp(sts, exp))


def build_bus_services(exp: RLExperiment) -> list[Obj]:
    """Client Service `{exp}-bus` (4222) and headless `{exp}-bus-headless` (per-pod DNS for routes)."""
    _embedded(exp)
    selector = L.selector_labels(exp, L.Role.BUS)
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(exp, naming.bus_name(exp), L.Component.BUS),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "client", "port": naming.BUS_CLIENT_PORT, "targetPort": "client", "protocol": "TCP"}],
        },
    }
    headless = headless_service(
        exp, naming.bus_headless_name(exp), L.Component.BUS, L.Role.BUS,
        {"client": naming.BUS_CLIENT_PORT, "cluster": naming.BUS_CLUSTER_PORT, "monitor": naming.BUS_MONITOR_PORT},
        # Routes must resolve before the servers are ready: they become ready only once clustered.
        spec_fields={"publishNotReadyAddresses": True},
    )
    return [with_spec_hash(client), headless]
