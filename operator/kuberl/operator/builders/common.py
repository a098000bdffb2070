"""Pieces shared by the child builders: metadata, hashes, images, env, volumes, security, scheduling.

Pure helpers for kuberl.operator.builders.* only; nothing here talks to the API or reads the environment.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

import kuberl
from kuberl.api.v1alpha1 import (
    ACCELERATOR_RESOURCE,
    AcceleratorSpec,
    AcceleratorType,
    RLExperiment,
    SchedulingSpec,
)
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import bus_auth

CONFIG_MOUNT_DIR = "/etc/kuberl"
CONFIG_KEY = "experiment.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT_DIR}/{CONFIG_KEY}"
WORKDIR = "/checkpoints"  # KUBERL_WORKDIR in every runtime pod (contracts.md)
CACHE_DIR = "/cache"  # HOME and caches (HF, vLLM, torch) on an emptyDir: the image may not own a home
# Volume mount roots; the runtime's defaults are the same (runtime/models.py MODEL_VOLUME_ROOT,
# runtime/data.py DATA_VOLUME_ROOT), though experiment.yaml already carries the absolute paths.
MODELS_DIR = "/models"  # spec.model.volume is mounted at /models/<claim>
DATASETS_DIR = "/data"  # spec.dataset.volume is mounted at /data/<claim>
DEFAULT_IMAGE_REPOSITORY = "ghcr.io/kuberl"  # where .github/workflows/images.yml publishes (docker-bake.hcl)
# The repository of the default runtime images. `kuberl operator` sets it once at start-up from
# $KUBERL_RUNTIME_IMAGE_REPOSITORY (the chart's runtimeImages.repository) through configure_images();
# the builders only read it, so they stay functions of (experiment, this setting).
IMAGE_REPOSITORY = DEFAULT_IMAGE_REPOSITORY
RUNTIME_UID = 1000  # the runtime images run as this user (images/ Dockerfiles)

Obj = dict[str, Any]


def stable_hash(value: Any) -> str:
    """16 hex chars of sha256 over canonical JSON: equal inputs, equal hash, on every machine."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def metadata(exp: RLExperiment, name: str, component: L.Component) -> Obj:
    return {"name": name, "namespace": exp.namespace, "labels": L.child_labels(exp, component)}


# Bookkeeping of builders.pinning: which spec a child was rendered for, not what the child is.
_UNHASHED = (L.SPEC_HASH_ANNOTATION, L.TEMPLATE_INPUTS_ANNOTATION, L.TEMPLATE_GENERATION_ANNOTATION)


def with_spec_hash(obj: Obj) -> Obj:
    """Stamp kuberl.io/spec-hash = hash of the object without that annotation (nor the pinning
    bookkeeping: a spec change elsewhere leaves the hash of an unaffected child as it was)."""
    obj = copy.deepcopy(obj)
    annotations = obj["metadata"].setdefault("annotations", {})
    annotations.pop(L.SPEC_HASH_ANNOTATION, None)
    hashed = copy.deepcopy(obj)
    for key in _UNHASHED:
        hashed["metadata"]["annotations"].pop(key, None)
    annotations[L.SPEC_HASH_ANNOTATION] = stable_hash(hashed)
    return obj


def headless_service(exp: RLExperiment, name: str, component: L.Component, role: L.Role, ports: dict[str, int],
                     spec_fields: Obj | None = None) -> Obj:
    """Headless Service `name` (per-pod DNS for `role`'s pods), spec-hashed; `ports`: name -> port, each
    targeting the container port of the same name. `spec_fields` (e.g. publishNotReadyAddresses) follow clusterIP."""
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata(exp, name, component),
            "spec": {
                "clusterIP": "None",
                **(spec_fields or {}),
                "selector": L.selector_labels(exp, role),
                "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"} for port_name, port in ports.items()],
            },
        }
    )


# --- images -----------------------------------------------------------------------------------
# An image repository without tag or digest (the distribution reference grammar): an optional
# registry host[:port], then lowercase path components, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/kuberl.
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"(?:{_HOST}/)?{_PATH}(?:/{_PATH})*")


def image_repository(value: str) -> str:
    """`value` as an image repository (a trailing "/" dropped); ValueError names what is wrong."""
    repo = value.strip().rstrip("/")
    if "@" in repo or ":" in repo.rpartition("/")[2]:
        raise ValueError(f"image repository {value!r} must not carry a tag or digest (the operator appends :<version>)")
    if not _REPOSITORY.fullmatch(repo):
        raise ValueError(f"image repository {value!r} is no valid repository (e.g. registry.example.com/team/kuberl)")
    return repo


def configure_images(repository: str | None) -> str:
    """Set the repository of the default runtime images (None or "": ghcr.io/kuberl); returns it.
    Called once by `kuberl operator` at start-up, before any handler runs."""
    global IMAGE_REPOSITORY
    IMAGE_REPOSITORY = image_repository(repository) if repository and repository.strip() else DEFAULT_IMAGE_REPOSITORY
    return IMAGE_REPOSITORY


def default_image(engine: str, accelerator: AcceleratorType | str, repository: str | None = None, version: str | None = None) -> str:
    """The KubeRL runtime image for an engine and accelerator: runtime-npu (ascend), runtime-cpu (cpu),
    else runtime-<engine>, under `repository` (default: the configured IMAGE_REPOSITORY), tagged
    `version` (default: the operator's own version)."""
    accel = AcceleratorType(accelerator)
    flavour = {AcceleratorType.ASCEND: "npu", AcceleratorType.CPU: "cpu"}.get(accel, str(engine))
    return f"{repository or IMAGE_REPOSITORY}/runtime-{flavour}:{version or kuberl.__version__}"


def image_of(exp: RLExperiment, sched: SchedulingSpec, accelerator: AcceleratorSpec) -> str:
    """The role's image: the spec's, else the default runtime image at the tag and repository pinned
    on the experiment (kuberl.io/runtime-version, kuberl.io/runtime-repository; builders.pinning)."""
    annotations = exp.metadata.annotations or {}
    return sched.image or default_image(
        exp.spec.rollout.engine, accelerator.type,
        repository=annotations.get(L.RUNTIME_REPOSITORY_ANNOTATION), version=annotations.get(L.RUNTIME_VERSION_ANNOTATION),
    )


# --- resources --------------------------------------------------------------------------------
def container_resources(sched: SchedulingSpec, accelerator: AcceleratorSpec) -> Obj:
    """The spec's requests/limits plus accelerators, requests == limits (extended resources demand it)."""
    requests = {k: str(v) for k, v in sched.resources.requests.items()}
    limits = {k: str(v) for k, v in sched.resources.limits.items()}
    resource = accelerator_resource(accelerator)
    if resource:
        requests[resource] = limits[resource] = str(accelerator.count)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def accelerator_resource(accelerator: AcceleratorSpec) -> str | None:
    """Extended resource name the pod asks for, or None (cpu, or a count of 0)."""
    if accelerator.type == AcceleratorType.CPU or accelerator.count == 0:
        return None
    return ACCELERATOR_RESOURCE[AcceleratorType(accelerator.type)]


# --- env --------------------------------------------------------------------------------------
def secret_env(name: str, secret: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def bus_env(exp: RLExperiment, role: str) -> list[Obj]:
    """KUBERL_BUS_URL, KUBERL_BUS_RUN (the run that scopes every bus name: namespace and uid) and the
    credentials: on the embedded bus KUBERL_BUS_USER = `role` and KUBERL_BUS_PASSWORD from that role's
    key of the bus Secret only (builders.bus_auth); on an external bus KUBERL_BUS_CREDS (the role's own minted
    user, with its inbox prefix KUBERL_BUS_INBOX) with accountSigningKeySecret, else KUBERL_BUS_TOKEN from its credentialsSecret."""
    env: list[Obj] = [{"name": "KUBERL_BUS_URL", "value": naming.bus_url(exp)}]
    run = naming.bus_run(exp)
    if run:
        env.append({"name": "KUBERL_BUS_RUN", "value": run})
    external = exp.spec.bus.external
    if external is None:
        env.append({"name": bus_auth.USER_ENV, "value": role})
        env.append(secret_env(bus_auth.PASSWORD_ENV, naming.bus_secret_name(exp), bus_auth.password_key(role)))
    elif external.account_signing_key_secret is not None:  # a user of its own, minted by the operator
        env.append(secret_env(bus_auth.CREDS_ENV, naming.bus_users_secret_name(exp), bus_auth.creds_key(role)))
        env.append({"name": bus_auth.INBOX_ENV, "value": bus_auth.inbox_prefix(bus_auth.bus_objects(exp))})
    elif external.credentials_secret is not None:
        ref = external.credentials_secret
        env.append(secret_env("KUBERL_BUS_TOKEN", ref.name, ref.key))
    return env


def runtime_env(exp: RLExperiment, role: str) -> list[Obj]:
    """Env of every runtime container of `role` (trainer, rollout): bus, workdir, caches, hub token where set."""
    env = bus_env(exp, role) + [
        {"name": "KUBERL_WORKDIR", "value": WORKDIR},
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    hub = exp.spec.model.hub_token_secret
    if hub is not None:
        env.append(secret_env("HF_TOKEN", hub.name, hub.key))
    return env


# --- volumes ----------------------------------------------------------------------------------
def config_volume(exp: RLExperiment) -> Obj:
    return {"name": "config", "configMap": {"name": naming.config_map_name(exp)}}


def config_mount() -> Obj:
    return {"name": "config", "mountPath": CONFIG_MOUNT_DIR, "readOnly": True}


def shm_volume() -> Obj:
    # NCCL, torch DataLoader workers and vLLM use /dev/shm; the container default is 64 MiB.
    return {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def shm_mount() -> Obj:
    return {"name": "dshm", "mountPath": "/dev/shm"}


def cache_volume() -> Obj:
    return {"name": "cache", "emptyDir": {}}


def cache_mount() -> Obj:
    return {"name": "cache", "mountPath": CACHE_DIR}


def data_volumes(exp: RLExperiment) -> tuple[list[Obj], list[Obj]]:
    """Volumes and read-only mounts for spec.model.volume and spec.dataset.volume (at /models|/data/<claim>)."""
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    for vol_name, ref, root in (("model", exp.spec.model.volume, MODELS_DIR), ("dataset", exp.spec.dataset.volume, DATASETS_DIR)):
        if ref is None:
            continue
        volumes.append({"name": vol_name, "persistentVolumeClaim": {"claimName": ref.claim_name, "readOnly": True}})
        mount: Obj = {"name": vol_name, "mountPath": f"{root}/{ref.claim_name}", "readOnly": True}
        if ref.sub_path:
            mount["subPath"] = ref.sub_path
        mounts.append(mount)
    return volumes, mounts


# --- security ---------------------------------------------------------------------------------
def pod_security_context(accelerator: AcceleratorSpec) -> Obj:
    """Non-root with a fixed uid/gid (and fsGroup so volumes are writable); Ascend driver files belong to
    root and HwHiAiUser, so NPU pods keep the image's user (uid 1000 in runtime-npu), still non-root:
    Pod Security "restricted" holds for every role."""
    ctx: Obj = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if accelerator.type != AcceleratorType.ASCEND:
        # OnRootMismatch: the kubelet re-owns a volume only when its root is not ours yet, instead of
        # walking every file of a large checkpoint volume on each pod start.
        ctx.update(runAsUser=RUNTIME_UID, runAsGroup=RUNTIME_UID, fsGroup=RUNTIME_UID, fsGroupChangePolicy="OnRootMismatch")
    return ctx


def container_security_context(add: list[str] | tuple[str, ...] = (), run_as_user: int | None = None) -> Obj:
    """Restricted: no privilege escalation, every capability dropped. `add` (podTemplate.capabilities, already
    checked against the API's allow-list) puts back only those; `run_as_user` 0 (a sidecar's choice) runs as root,
    the only way the kernel makes added capabilities effective."""
    ctx: Obj = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], **({"add": list(add)} if add else {})}}
    if run_as_user is not None:
        ctx["runAsUser"] = run_as_user
        if run_as_user == 0:
            ctx["runAsNonRoot"] = False  # the pod's runAsNonRoot would refuse it at container start
    return ctx


# --- scheduling -------------------------------------------------------------------------------
def scheduling_fields(sched: SchedulingSpec) -> Obj:
    """nodeSelector, tolerations, affinity, priorityClassName, as set in the spec."""
    out: Obj = {}
    if sched.node_selector:
        out["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        out["tolerations"] = copy.deepcopy(sched.tolerations)
    if sched.affinity:
        out["affinity"] = copy.deepcopy(sched.affinity)
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    return out


def pull_policy(sched: SchedulingSpec) -> Obj:
    return {"imagePullPolicy": sched.image_pull_policy} if sched.image_pull_policy else {}
