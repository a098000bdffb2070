"""The checkpoint PersistentVolumeClaim (unless spec.checkpoint.existingClaim names one).

Called by builders.build_children and the kopf handlers (O2). The trainer mounts it read-write at
/checkpoints; in disk weight-sync mode the rollout pods mount it read-only there too.
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import Obj, metadata, with_spec_hash


def checkpoint_access_mode(exp: RLExperiment) -> str:
    """ReadWriteMany when pods on different nodes share it: disk weight sync (trainer writes, engines
    read) or a multi-node trainer; ReadWriteOnce otherwise (bus sync, one trainer pod)."""
    if exp.spec.weight_sync.mode == "disk" or exp.spec.trainer.nodes > 1:
        return "ReadWriteMany"
    return "ReadWriteOnce"


def build_checkpoint_pvc(exp: RLExperiment) -> Obj | None:
    """PVC `{exp}-checkpoints`, or None when spec.checkpoint.existingClaim is set."""
    ckpt = exp.spec.checkpoint
    if ckpt.existing_claim is not None:
        return None
    spec: Obj = {"accessModes": [checkpoint_access_mode(exp)], "resources": {"requests": {"storage": str(ckpt.size)}}}
    if ckpt.storage_class_name:
        spec["storageClassName"] = ckpt.storage_class_name
    return with_spec_hash(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": metadata(exp, naming.checkpoint_pvc_name(exp), L.Component.STORAGE),
            "spec": spec,
        }
    )
