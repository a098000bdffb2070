"""The pod template shared by the runtime workloads: the rollout StatefulSet and the trainer Job.

Called by builders.rollout and builders.trainer, which add their containers and own volumes. Pure, like
every builder: labels, config-hash annotation, a token-less service account, non-root security,
the role's scheduling fields and the config, shm and cache volumes every runtime container mounts.
"""

from __future__ import annotations

from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import (
    Obj,
    cache_volume,
    config_volume,
    pod_security_context,
    scheduling_fields,
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
