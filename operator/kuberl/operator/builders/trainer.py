"""The trainer: an indexed Job (one pod per node, torchrun with static rendezvous) and its headless Service.

Called by builders.build_children and the kopf handlers (O2).

Restarts: the Job has backoffLimit 0 and restartPolicy Never. With static rendezvous a failed rank
leaves the others hanging, so retrying one pod (what the Job controller would do) cannot recover;
instead the operator re-creates the whole Job after failurePolicy.backoffSeconds (doubling), up to
failurePolicy.maxRestarts times, and the trainer resumes from the last checkpoint.
Configuration errors: a trainer that exits 2 (contracts.md) cannot succeed on a retry; the Job's
podFailurePolicy fails it at once with reason PodFailurePolicy, and the operator does not restart it
but fails the experiment with the container's termination message.
Suspension: spec.suspend sets the Job's own `spec.suspend`, which stops its pods and keeps the Job.
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import bus_auth, pinning
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

TRAINER_CONTAINER = "trainer"
# The trainer checkpoints on SIGTERM (preemption, drain, a Kueue eviction, suspend): FSDP optimizer
# state of a 7B model to a network volume takes minutes, not the default 30 s.
TERMINATION_GRACE_SECONDS = 600
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# The runtime's exit code for a configuration error (contracts.md; kuberl.runtime.errors, which the
# operator does not import).
CONFIG_ERROR_EXIT_CODE = 2
# torchrun itself exits 1 whatever its ranks exit with; this module runs torchrun and passes a rank's
# exit code 2 on, so that the podFailurePolicy below can see it.
TORCHRUN = ["python", "-m", "kuberl.runtime.trainer.torchrun"]
# Rank 0's Prometheus endpoint (/metrics, kuberl.runtime.prom): $KUBERL_METRICS_PORT, the port named
# `metrics` that the chart's PodMonitor scrapes. The other ranks serve none (their port stays closed).
METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"
METRICS_PORT_ENV = "KUBERL_METRICS_PORT"


def trainer_command(exp: RLExperiment) -> list[str]:
    """The torchrun command of contracts.md; the node rank comes from the Job completion index."""
    t = exp.spec.trainer
    return [
        *TORCHRUN,
        "--nnodes", str(t.nodes),
        "--nproc-per-node", str(max(t.accelerator.count, 1)),
        "--node-rank", "$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend", "static",
        "--master-addr", naming.trainer_master_address(exp),
        "--master-port", str(naming.TRAINER_MASTER_PORT),
        "--no-python",
        "kuberl", "trainer", "--config", CONFIG_PATH,
    ]  # fmt: skip


def pod_failure_policy() -> Obj:
    """Fail the Job at once (no replacement pod, reason PodFailurePolicy) when the trainer exits 2.

    Every other failure counts against backoffLimit 0, which fails the Job too, and the operator then
    re-creates the whole Job under spec.failurePolicy: that is what the Job needs, so there is no
    `Ignore` rule for the DisruptionTarget condition (preemption, eviction, node drain). `Ignore`
    would make the Job controller replace just the disrupted pod; with torchrun's static rendezvous
    a lone new rank cannot join the ranks still running (they fail or hang in a collective), so the
    restart of the whole Job from the last checkpoint is the recovery that works, for one node or many.
    """
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": TRAINER_CONTAINER, "operator": "In", "values": [CONFIG_ERROR_EXIT_CODE]}},
    ]}


def tracking_env(exp: RLExperiment) -> list[Obj]:
    """spec.tracking's credentials (W&B API key, MLflow token) as env from their Secrets (secretKeyRef), never as values."""
    t = exp.spec.tracking
    return [{"name": env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}} for env, ref in (t.secret_env() if t else [])]


WEIGHT_SYNC_PORT_NAME = "weight-sync"
# The env kuberl.runtime.weight_sync.sender reads (the operator never imports the runtime): where engines reach rank 0's store.
WEIGHT_SYNC_HOST_ENV = "KUBERL_WEIGHT_SYNC_HOST"
WEIGHT_SYNC_PORT_ENV = "KUBERL_WEIGHT_SYNC_PORT"


def weight_sync_env(exp: RLExperiment) -> list[Obj]:
    """weightSync.mode broadcast: rank 0's pod DNS name and the store port, which the engines connect to (network.py admits them)."""
    if exp.spec.weight_sync.mode != "broadcast":
        return []
    return [{"name": WEIGHT_SYNC_HOST_ENV, "value": naming.trainer_master_address(exp)},
            {"name": WEIGHT_SYNC_PORT_ENV, "value": str(exp.spec.weight_sync.port)}]


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
            *runtime_env(exp, bus_auth.TRAINER),
            *tracking_env(exp),
            {"name": METRICS_PORT_ENV, "value": str(METRICS_PORT)},
            *weight_sync_env(exp),
        ],
        mounts=[{"name": "checkpoints", "mountPath": WORKDIR}, *data_mounts],
        resources=container_resources(t, t.accelerator),
        ports=[{"name": "rendezvous", "containerPort": naming.TRAINER_MASTER_PORT, "protocol": "TCP"},
               {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
               *([{"name": WEIGHT_SYNC_PORT_NAME, "containerPort": exp.spec.weight_sync.port, "protocol": "TCP"}]
                 if exp.spec.weight_sync.mode == "broadcast" else [])],
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
            "podFailurePolicy": pod_failure_policy(),  # needs restartPolicy Never (below)
            "suspend": exp.spec.suspend,
            # Job pods get their own label selector from the Job controller.
            "template": runtime_pod_template(
                exp, L.Component.TRAINER, t, t.accelerator, default_container=TRAINER_CONTAINER, containers=[container],
                volumes=[{"name": "checkpoints", "persistentVolumeClaim": {"claimName": naming.checkpoint_claim_name(exp)}}, *data_vols],
                spec_fields={
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
                    # Pod DNS `{job}-{index}.{service}`: rank 0 is the torchrun master.
                    "subdomain": naming.trainer_name(exp),
                },
            ),
        },
    }
    return with_spec_hash(pinning.stamp(job, exp))


def build_trainer_pdb(exp: RLExperiment) -> Obj:
    """PodDisruptionBudget `{exp}-trainer`: no voluntary eviction of a trainer pod (a node drain or the
    cluster autoscaler's scale-down waits). One lost rank fails the whole Job and costs a restart from
    the last checkpoint (failurePolicy.maxRestarts); `spec.suspend` is the way to move a trainer.

    minAvailable as a count of all the Job's pods, not maxUnavailable 0: the disruption controller works out a
    maxUnavailable budget from the owner's scale subresource, which a Job lacks, and then reports
    CalculateExpectedPodCountFailed on every sync (seen on a real controller manager)."""
    return with_spec_hash({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(exp, naming.trainer_network_policy_name(exp), L.Component.TRAINER),
        "spec": {"minAvailable": exp.spec.trainer.nodes, "selector": {"matchLabels": L.selector_labels(exp, L.Role.TRAINER)}},
    })


def build_trainer_service(exp: RLExperiment) -> Obj:
    """Headless Service `{exp}-trainer` for torchrun rendezvous; lists pods before they are ready."""
    return headless_service(
        exp, naming.trainer_name(exp), L.Component.TRAINER, L.Role.TRAINER, {"rendezvous": naming.TRAINER_MASTER_PORT},
        # The master must resolve while every rank is still starting (none is ready yet).
        spec_fields={"publishNotReadyAddresses": True},
    )
