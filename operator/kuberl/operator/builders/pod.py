"""The pod template and containers shared by the runtime workloads: the rollout StatefulSet and the trainer Job.

Called by builders.rollout and builders.trainer, which add commands, ports, probes and their own volumes.
Pure, like every builder: labels, config-hash annotation, a token-less service account, non-root security,
the role's image and scheduling fields, and the config, shm and cache volumes runtime containers mount.
Last, the role's `podTemplate` overrides are merged in (`apply_pod_overrides`): labels, annotations and
env by key or name (the user's win), volumes and mounts added, pod fields replaced; then what the fabrics need
(`apply_fabric`): native sidecars, added capabilities and extended resources on the main container, the /dev/shm size.
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import AcceleratorSpec, PodTemplateOverride, RLExperiment, SchedulingSpec, Sidecar
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import (
    Obj,
    cache_mount,
    cache_volume,
    config_mount,
    config_volume,
    container_security_context,
    image_of,
    pod_security_context,
    pull_policy,
    scheduling_fields,
    shm_mount,
    shm_volume,
)
from kuberl.operator.builders.config import config_hash

# PodTemplateOverride field -> the pod spec field it replaces.
_POD_FIELDS = {
    "service_account_name": "serviceAccountName",
    "runtime_class_name": "runtimeClassName",
    "scheduler_name": "schedulerName",
    "termination_grace_period_seconds": "terminationGracePeriodSeconds",
}


def merge_by(key: str, ours: list[Obj], theirs: list[Obj]) -> list[Obj]:
    """Strategic merge of two lists keyed by `key`: an item of theirs replaces ours of the same key
    in place; new ones are appended in their order."""
    replaced = {item[key]: item for item in theirs}
    out = [replaced.pop(item[key], item) for item in ours]
    return out + [item for item in theirs if item[key] in replaced]


def apply_pod_overrides(template: Obj, override: PodTemplateOverride | None) -> Obj:
    """`template` (a pod template the builders rendered) with the role's overrides merged in."""
    if override is None:
        return template
    meta, spec = template["metadata"], template["spec"]
    meta["labels"] = {**override.labels, **meta.get("labels", {})}  # the API refuses ours being overridden
    meta["annotations"] = {**meta.get("annotations", {}), **override.annotations}
    env = [e.to_manifest() for e in override.env]
    for c in spec["containers"]:
        c["env"] = merge_by("name", c.get("env") or [], env)
        c["volumeMounts"] = merge_by("name", c.get("volumeMounts") or [], [dict(m) for m in override.volume_mounts])
    spec["volumes"] = merge_by("name", spec.get("volumes") or [], [dict(v) for v in override.volumes])
    if override.image_pull_secrets:
        spec["imagePullSecrets"] = merge_by("name", spec.get("imagePullSecrets") or [], [r.to_manifest() for r in override.image_pull_secrets])
    if override.topology_spread_constraints:
        spec["topologySpreadConstraints"] = [dict(t) for t in override.topology_spread_constraints]
    for field, pod_field in _POD_FIELDS.items():
        value = getattr(override, field)
        if value is not None:
            spec[pod_field] = value
    return apply_fabric(template, override)


def apply_fabric(template: Obj, override: PodTemplateOverride) -> Obj:
    """What multi-node fabrics (EFA, GPUDirect-TCPX/TCPXO) ask of a pod, and only where asked: the sidecars as
    native sidecars after any init container, the capabilities and extended resources on the main container
    (the first: the trainer, or the rollout's engine; not its agent), the /dev/shm size limit.
    Every capability not named stays dropped."""
    spec = template["spec"]
    if override.sidecars:
        spec["initContainers"] = [*(spec.get("initContainers") or []), *(sidecar_container(s) for s in override.sidecars)]
    main = spec["containers"][0]  # the builders put the accelerator's user first: the trainer, the engine (before its agent)
    if override.capabilities:
        main["securityContext"] = container_security_context(override.capabilities)
    if override.extended_resources:
        resources = main.setdefault("resources", {})
        for part in ("requests", "limits"):  # extended resources and hugepages: requests == limits, or the API server refuses
            resources[part] = {**resources.get(part, {}), **{k: str(v) for k, v in override.extended_resources.items()}}
    if override.shm_size_limit is not None:
        for volume in spec["volumes"]:
            if volume["name"] == "dshm":
                volume["emptyDir"]["sizeLimit"] = str(override.shm_size_limit)
    return template


def sidecar_container(sidecar: Sidecar) -> Obj:
    """A native sidecar (restartPolicy Always: it starts before the role's containers, restarts on its own and
    does not hold a Job's pod from completing) under the restricted context plus its own capabilities and user."""
    container: Obj = {"name": sidecar.name, "image": sidecar.image, "restartPolicy": "Always"}
    if sidecar.image_pull_policy:
        container["imagePullPolicy"] = sidecar.image_pull_policy
    for field, value in (("command", sidecar.command), ("args", sidecar.args), ("env", [e.to_manifest() for e in sidecar.env]),
                         ("volumeMounts", [dict(m) for m in sidecar.volume_mounts])):
        if value:
            container[field] = value
    resources = sidecar.resources.to_manifest()
    if resources.get("requests") or resources.get("limits"):
        container["resources"] = {k: {n: str(q) for n, q in v.items()} for k, v in resources.items() if v}
    container["securityContext"] = container_security_context(sidecar.capabilities, run_as_user=sidecar.run_as_user)
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return container


def runtime_pod_template(
    exp: RLExperiment,
    component: L.Component,
    sched: SchedulingSpec,
    accelerator: AcceleratorSpec,
    *,
    default_container: str,
    containers: list[Obj],
    volumes: list[Obj],
    spec_fields: Obj | None = None,
) -> Obj:
    """The pod template of a runtime workload.

    `volumes` come after config, shm and cache; `spec_fields` (e.g. restartPolicy) lead the pod spec.
    Pods roll when the resolved experiment (config_hash) changes; `kubectl logs` picks default_container.
    """
    return apply_pod_overrides({
        "metadata": {
            "labels": L.child_labels(exp, component),
            "annotations": {L.CONFIG_HASH_ANNOTATION: config_hash(exp), L.DEFAULT_CONTAINER_ANNOTATION: default_container},
        },
        "spec": {
            **(spec_fields or {}),
            "serviceAccountName": naming.service_account_name(exp),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security_context(accelerator),
            **scheduling_fields(sched),
            "containers": containers,
            "volumes": [config_volume(exp), shm_volume(), cache_volume(), *volumes],
        },
    }, sched.pod_template)


def runtime_container(
    exp: RLExperiment,
    sched: SchedulingSpec,
    accelerator: AcceleratorSpec,
    *,
    name: str,
    command: list[str],
    env: list[Obj],
    mounts: list[Obj],
    resources: Obj,
    shm: bool = True,
    **fields: Obj | list[Obj],
) -> Obj:
    """A runtime container: the role's image, the config (and shm, unless shm=False) and cache mounts before `mounts`.

    `resources` is left out when empty; `fields` (ports, probes) are set as given. The roles write the
    reason of a configuration error to /dev/termination-log (contracts.md); a container that dies
    without writing one gets the tail of its log as termination message (FallbackToLogsOnError), so
    the operator's condition and `kubectl describe pod` show why without `kubectl logs`.
    """
    container: Obj = {
        "name": name,
        "image": image_of(exp, sched, accelerator),
        **pull_policy(sched),
        "command": command,
        "env": env,
        **fields,
        "volumeMounts": [config_mount(), *([shm_mount()] if shm else []), cache_mount(), *mounts],
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if resources:
        container["resources"] = resources
    return container
