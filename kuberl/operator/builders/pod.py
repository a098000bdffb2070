"""The pod template and containers shared by the runtime workloads: the rollout StatefulSet and the trainer Job.

Called by builders.rollout and builders.trainer, which add commands, ports, probes and their own volumes.
Pure, like every builder: labels, config-hash annotation, a token-less service account, non-root security,
the role's image and scheduling fields, and the config, shm and cache volumes runtime containers mount.
"""

from __future__ import annotations

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

from kuberl.api.v1alpha1 import AcceleratorSpec, RLExperiment, SchedulingSpec


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
    return {
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
    }


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
