"""Pod-level settings shared by the rollout and trainer specs: pod template overrides and scheduling."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kuberl.api.base import KubeModel, ResourceRequirements, _cel

# Pod template overrides: label and annotation keys, env names and volume names the operator owns.
RESERVED_LABEL_PREFIXES = ("kuberl.io/", "app.kubernetes.io/")
RESERVED_ENV_PREFIX = "KUBERL_"
RESERVED_VOLUMES = ("config", "dshm", "cache", "workdir", "checkpoints", "model", "dataset")
OVERRIDE_LABEL_MESSAGE = ("podTemplate.labels and podTemplate.annotations must not use the kuberl.io/ or app.kubernetes.io/ prefixes "
                          "(the operator's selectors and bookkeeping)")
OVERRIDE_ENV_MESSAGE = "podTemplate.env must not set KUBERL_* variables (the operator sets them from the spec)"
OVERRIDE_VOLUME_MESSAGE = "podTemplate.volumes must not reuse the names config, dshm, cache, workdir, checkpoints, model or dataset"
# core/v1 Volume and VolumeMount items: free-form, but their `name` is declared (and required) so that CEL rules
# may read it. The API server type-checks rules against declared properties only and ignores preserve-unknown-fields.
_NAMED_ITEMS = {"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "required": ["name"],
                          "properties": {"name": {"type": "string", "minLength": 1}}}}
_FREE_FORM_ITEMS = {"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}


class EnvVar(KubeModel):
    """An environment variable (core/v1 EnvVar): a value, or valueFrom (secretKeyRef, configMapKeyRef, fieldRef, ...)."""

    name: str = Field(description="Variable name.", min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = Field(None, description="Value.")
    value_from: dict[str, Any] | None = Field(
        None, description="Source of the value (core/v1 EnvVarSource).", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


class LocalObjectReference(KubeModel):
    name: str = Field(description="Name of an object in the experiment's namespace.", min_length=1, max_length=253)


class PodTemplateOverride(KubeModel):
    """Additions to a role's pods, merged into what the operator renders (like KubeRay's and Kubeflow
    Trainer's podTemplateOverrides): labels, annotations and env merge by key or name (yours win),
    volumes and mounts are added, the pod fields replace the operator's. Every runtime container of the
    role gets the env and the mounts."""

    model_config = _cel(
        ("(!has(self.labels) || self.labels.all(k, !k.startsWith('kuberl.io/') && !k.startsWith('app.kubernetes.io/'))) && "
         "(!has(self.annotations) || self.annotations.all(k, !k.startsWith('kuberl.io/') && !k.startsWith('app.kubernetes.io/')))",
         OVERRIDE_LABEL_MESSAGE, ".labels"),
        ("!has(self.env) || self.env.all(e, !e.name.startsWith('KUBERL_'))", OVERRIDE_ENV_MESSAGE, ".env"),
        ("!has(self.volumes) || self.volumes.all(v, !(v.name in ['config', 'dshm', 'cache', 'workdir', 'checkpoints', 'model', 'dataset']))",
         OVERRIDE_VOLUME_MESSAGE, ".volumes"),
    )
    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Pod labels, e.g. sidecar.istio.io/inject or a Kueue pod-group label.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64,
                                        description="Pod annotations, e.g. cluster-autoscaler.kubernetes.io/safe-to-evict.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              description="Environment of every runtime container of the role (NCCL_*, HTTP(S)_PROXY, HF_*).")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Extra pod volumes (core/v1 Volume), each with a name.", json_schema_extra=_NAMED_ITEMS
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Mounts of the extra volumes in every runtime container of the role (core/v1 VolumeMount).",
        json_schema_extra=_NAMED_ITEMS,
    )
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description="Secrets to pull a private image with.")
    service_account_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="Run as this ServiceAccount (GKE Workload Identity, EKS IRSA/Pod Identity) instead of {experiment}-runtime."
    )
    runtime_class_name: str | None = Field(None, min_length=1, max_length=253, description="RuntimeClass, e.g. nvidia (GPU Operator clusters).")
    scheduler_name: str | None = Field(None, min_length=1, max_length=253, description="Scheduler, e.g. volcano for gang scheduling.")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16, description="core/v1 TopologySpreadConstraints of the pods.", json_schema_extra=_FREE_FORM_ITEMS
    )
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, le=86400, description="Seconds between SIGTERM and SIGKILL (default: 600 for the trainer, which checkpoints on SIGTERM; 30 otherwise)."
    )

    @model_validator(mode="after")
    def _rules(self) -> PodTemplateOverride:
        if any(k.startswith(RESERVED_LABEL_PREFIXES) for k in (*self.labels, *self.annotations)):
            raise ValueError(OVERRIDE_LABEL_MESSAGE)
        if any(e.name.startswith(RESERVED_ENV_PREFIX) for e in self.env):
            raise ValueError(OVERRIDE_ENV_MESSAGE)
        for kind, items in (("volumes", self.volumes), ("volumeMounts", self.volume_mounts)):
            for item in items:
                if not isinstance(item.get("name"), str) or not item["name"]:
                    raise ValueError(f"podTemplate.{kind}: every item needs a name")
        if any(v["name"] in RESERVED_VOLUMES for v in self.volumes):
            raise ValueError(OVERRIDE_VOLUME_MESSAGE)
        return self


class SchedulingSpec(KubeModel):
    """Pod placement and resources shared by the rollout and trainer blocks."""

    image: str | None = Field(None, description="Container image; default: the KubeRL runtime image for the engine and accelerator.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description="Image pull policy.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="CPU and memory requests/limits.")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64, description="Node labels the pods must match.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=64,
        description="Pod tolerations (core/v1 Toleration objects).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Pod affinity (core/v1 Affinity).", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    priority_class_name: str | None = Field(None, description="PriorityClass of the pods.")
    pod_template: PodTemplateOverride | None = Field(
        None, description="Additions to the pods (env, labels, volumes, service account, ...), merged into the operator's.")


# ---------------------------------------------------------------------------------------------
# Model, data set, workflow
# ---------------------------------------------------------------------------------------------

