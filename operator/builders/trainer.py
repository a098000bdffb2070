"""The trainer: an indexed Job (one pod per node, torchrun with static rendezvous) and its headless Service.

Called by builders.build_children and the kopf handlers (O2).

Restarts: the Job has backoffLimit 0 and restartPolicy Never. With static rendezvous a failed rank
leaves the others hanging, so retrying one pod (what the Job controller would do) cannot recover;
instead the operator re-creates the whole Job after failurePolicy.backoffSeconds (doubling), up to
failurePolicy.maxRestarts times, and the trainer resumes from the last checkpoint.
Suspension: spec.suspend sets the Job's own `spec.suspend`, which stops its pods and keeps the Job.
"""

from __future__ import annotations

from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders.common import (
    CONFIG_PATH,
    WORKDIR,
    Obj,
    container_resources,
    data_volumes,
    headless_service,
    metadata,
    runtime_env,
    with_spec_hash,
)
from kuberl.operator.builders.pod import runtime_container, runtime_pod_template

from kuberl.api.v1alpha1 import RLExperiment

TRAINER_CONTAINER = "trainer"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def trainer_command(exp: RLExperiment) -> list[str]:
    """The torchrun command of contracts.md; the node rank comes from the Job completion index."""
    t = exp.spec.trainer
    return [
        "torchrun",
        "--nnodes", str(t.nodes),
        "--nproc-per-node", str(max(t.accelerator.count, 1)),
        "--node-rank", "$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend", "static",
        "--master-addr", naming.trainer_master_address(exp),
        "--master-port", str(naming.TRAINER_MASTER_PORT),
        "--no-python",
        "kuberl", "trainer", "--config", CONFIG_PATH,
    ]  # fmt: skip


def build_trainer_job(exp: RLExperiment) -> Obj:
    """Indexed Job `{exp}-trainer`: completions = parallelism = trainer.nodes, suspended with the experiment."""
    t = exp.spec.trainer
    name = naming.trainer_name(exp)
    data_vols, data_mounts = data_volumes(exp)
    container = runtime_container(
        exp, t, t.accelerator,
        name=TRAINER_CONTAINER,
        command=trainer_command(exp),
        env=[
            # Declared here (the Job controller adds it too) so $(JOB_COMPLETION_INDEX) in the command
            # expands from a variable the pod spec itself names.
            {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}},
            *runtime_env(exp),
        ],
        mounts=[{"name": "checkpoints", "mountPath": WORKDIR}, *data_mounts],
        resources=container_resources(t, t.accelerator),
        ports=[{"name": "rendezvous", "containerPort": naming.TRAINER_MASTER_PORT, "protocol": "TCP"}],
    )
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(exp, name, L.Component.TRAINER),
        "spec": {
            "completionMode": "Indexed",
            "completions": t.nodes,
            "parallelism": t.nodes,
            "backoffLimit": 0,  # the operator restarts the whole Job (module docstring)
            "suspend": exp.spec.suspend,
            # Job pods get their own label selector from the Job controller.
            "template": runtime_pod_template(
                exp, L.Component.TRAINER, t, t.accelerator, default_container=TRAINER_CONTAINER, containers=[container],
                volumes=[{"name": "checkpoints", "persistentVolumeClaim": {"claimName": naming.checkpoint_claim_name(exp)}}, *data_vols],
                spec_fields={
                    "restartPolicy": "Never",
                    # Pod DNS `{job}-{index}.{service}`: rank 0 is the torchrun master.
                    "subdomain": naming.trainer_name(exp),
                },
            ),
        },
    }
    return with_spec_hash(job)


def build_trainer_service(exp: RLExperiment) -> Obj:
    """Headless Service `{exp}-trainer` for torchrun rendezvous; lists pods before they are ready."""
    return headless_service(
        exp, naming.trainer_name(exp), L.Component.TRAINER, L.Role.TRAINER, {"rendezvous": naming.TRAINER_MASTER_PORT},
        # The master must resolve while every rank is still starting (none is ready yet).
        spec_fields={"publishNotReadyAddresses": True},
    )
