"""Pod-level settings shared by the rollout and trainer specs: pod template overrides and scheduling."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kuberl.api.base import DNS1123_LABEL, KubeModel, Quantity, ResourceRequirements, _cel, _check_quantity

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

# What the fabrics need and no more: IPC_LOCK (EFA and GPUDirect memory registration), NET_ADMIN and NET_BIND_SERVICE
# (GKE's GPUDirect-TCPX/TCPXO receive-datapath daemon). Everything else (SYS_ADMIN, SYS_PTRACE, privileged...) is refused.
FABRIC_CAPABILITIES = ("IPC_LOCK", "NET_ADMIN", "NET_BIND_SERVICE")
CAPABILITY_MESSAGE = ("podTemplate capabilities may add only IPC_LOCK, NET_ADMIN and NET_BIND_SERVICE (what EFA and GPUDirect-TCPX/TCPXO need), "
                      "written without the CAP_ prefix; SYS_ADMIN and every other capability are refused")
_CAPABILITY_RULE = "!has(self.capabilities) || self.capabilities.all(c, c in ['IPC_LOCK', 'NET_ADMIN', 'NET_BIND_SERVICE'])"
# Containers the operator renders; a sidecar may not take their names (`kubectl logs -c` and the NRI device annotations
# devices.gke.io/container.<name> address containers by name).
RESERVED_CONTAINERS = ("engine", "rollout-agent", "trainer")
SIDECAR_NAME_MESSAGE = "podTemplate.sidecars: names must be unique and not engine, rollout-agent or trainer (the operator's containers)"
ACCELERATOR_RESOURCES = ("nvidia.com/gpu", "huawei.com/Ascend910")
EXTENDED_RESOURCE_MESSAGE = ("podTemplate.extendedResources takes extended resources (<vendor domain>/<name>, e.g. vpc.amazonaws.com/efa) "
                             "and hugepages-<size>; cpu and memory belong in resources, GPUs and NPUs in accelerator")
HUGEPAGES_MESSAGE = ("podTemplate.extendedResources: hugepages need a cpu or memory request or limit in resources "
                     "(the API server refuses a container with hugepages alone)")
# On RolloutSpec and TrainerSpec (the rule needs both `resources` and `podTemplate`).
HUGEPAGES_RULE = ("!has(self.podTemplate) || !has(self.podTemplate.extendedResources) || "
                  "!self.podTemplate.extendedResources.exists(k, k.startsWith('hugepages-')) || "
                  "(has(self.resources) && ((has(self.resources.requests) && ('cpu' in self.resources.requests || 'memory' in self.resources.requests)) || "
                  "(has(self.resources.limits) && ('cpu' in self.resources.limits || 'memory' in self.resources.limits))))")


def _is_extended_resource(name: str) -> bool:
    """A name the pod may ask for here: hugepages-<size>, or a vendor's extended resource (not kubernetes.io's, not an accelerator)."""
    if name.startswith("hugepages-"):
        return True
    return "/" in name and "kubernetes.io/" not in name and name not in ACCELERATOR_RESOURCES


class EnvVar(KubeModel):
    """An environment variable (core/v1 EnvVar): a value, or valueFrom (secretKeyRef, configMapKeyRef, fieldRef, ...)."""

    name: str = Field(description="Variable name.", min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = Field(None, description="Value.")
    value_from: dict[str, Any] | None = Field(
        None, description="Source of the value (core/v1 EnvVarSource).", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


class LocalObjectReference(KubeModel):
    name: str = Field(description="Name of an object in the experiment's namespace.", min_length=1, max_length=253)


class Sidecar(KubeModel):
    """A container that runs beside the role's containers for the pod's whole life (a native sidecar: an init
    container with restartPolicy Always, started before them and stopped after them), e.g. GKE's tcpxo-daemon.
    It gets the restricted security context (no privilege escalation, every capability dropped) plus the
    capabilities it names; it mounts only what volumeMounts names."""

    model_config = _cel((_CAPABILITY_RULE, CAPABILITY_MESSAGE, ".capabilities"))
    name: str = Field(description="Container name (a DNS label), unique in the pod.", min_length=1, max_length=63, pattern=DNS1123_LABEL)
    image: str = Field(description="Container image.", min_length=1, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(None, description="Image pull policy.")
    command: list[str] = Field(default_factory=list, max_length=64, description="Entrypoint; default: the image's.")
    args: list[str] = Field(default_factory=list, max_length=256, description="Arguments of the entrypoint.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Environment of the sidecar.")
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Mounts (core/v1 VolumeMount) of podTemplate.volumes, or of dshm (/dev/shm).",
        json_schema_extra=_NAMED_ITEMS,
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description="CPU and memory requests/limits.")
    capabilities: list[str] = Field(
        default_factory=list, max_length=3,
        description="Linux capabilities added to the sidecar's: IPC_LOCK, NET_ADMIN, NET_BIND_SERVICE (GKE's tcpxo-daemon needs the last two).",
    )
    run_as_user: int | None = Field(
        None, ge=0, le=2147483647,
        description=("User ID the sidecar runs as; default: the pod's (1000, non-root). 0 runs it as root, which a daemon needs "
                     "for its added capabilities to take effect (the kernel gives a non-root process none of them)."),
    )

    @model_validator(mode="after")
    def _rules(self) -> Sidecar:
        if any(c not in FABRIC_CAPABILITIES for c in self.capabilities):
            raise ValueError(CAPABILITY_MESSAGE)
        if any(not isinstance(m.get("name"), str) or not m["name"] for m in self.volume_mounts):
            raise ValueError(f"podTemplate.sidecars[{self.name}].volumeMounts: every item needs a name")
        return self


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
        (_CAPABILITY_RULE, CAPABILITY_MESSAGE, ".capabilities"),
        ("!has(self.sidecars) || self.sidecars.all(s, !(s.name in ['engine', 'rollout-agent', 'trainer']) && self.sidecars.exists_one(o, o.name == s.name))",
         SIDECAR_NAME_MESSAGE, ".sidecars"),
        ("!has(self.extendedResources) || self.extendedResources.all(k, k.startsWith('hugepages-') || (k.contains('/') && !k.contains('kubernetes.io/') && "
         "!(k in ['nvidia.com/gpu', 'huawei.com/Ascend910'])))", EXTENDED_RESOURCE_MESSAGE, ".extendedResources"),
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
    sidecars: list[Sidecar] = Field(
        default_factory=list, max_length=8,
        description=("Containers that run beside the role's for the pod's life (native sidecars: init containers with restartPolicy "
                     "Always), e.g. GKE's tcpxo-daemon for GPUDirect-TCPXO."),
    )
    capabilities: list[str] = Field(
        default_factory=list, max_length=3,
        description=("Linux capabilities added to the role's main container (the trainer, or the rollout's engine), whose others stay "
                     "dropped: IPC_LOCK (EFA, GPUDirect memory registration), NET_ADMIN, NET_BIND_SERVICE; nothing else."),
    )
    extended_resources: dict[str, Quantity] = Field(
        default_factory=dict, max_length=16,
        description=("Extended resources and hugepages for the role's main container, requested and limited alike (as the API server "
                     "requires of them), e.g. {vpc.amazonaws.com/efa: 32, hugepages-2Mi: 5120Mi} on an EKS p5.48xlarge."),
    )
    shm_size_limit: Quantity | None = Field(
        None, description="Size limit of the memory-backed /dev/shm (NCCL's and the engines' shared memory); default: none (half the node's memory).",
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
        self._fabric_rules()
        return self

    def _fabric_rules(self) -> None:
        """The pydantic twin of the CEL rules on capabilities, sidecar names and extended resources."""
        if any(c not in FABRIC_CAPABILITIES for c in self.capabilities):
            raise ValueError(CAPABILITY_MESSAGE)
        names = [s.name for s in self.sidecars]
        if len(set(names)) != len(names) or any(n in RESERVED_CONTAINERS for n in names):
            raise ValueError(SIDECAR_NAME_MESSAGE)
        for name, value in self.extended_resources.items():
            if not _is_extended_resource(name):
                raise ValueError(EXTENDED_RESOURCE_MESSAGE)
            _check_quantity(value, f"podTemplate.extendedResources.{name}")
        if self.shm_size_limit is not None:
            _check_quantity(self.shm_size_limit, "podTemplate.shmSizeLimit")

    def wants_hugepages(self) -> bool:
        return any(k.startswith("hugepages-") for k in self.extended_resources)


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
        None, description=("Additions to the pods (env, labels, volumes, service account, sidecars, capabilities, extended resources...), "
                           "merged into the operator's."))

    @model_validator(mode="after")
    def _hugepages(self) -> SchedulingSpec:
        """Hugepages alone make the API server refuse the pod (at the StatefulSet's or Job's pod creation, long after
        admission): say so when the experiment is admitted."""
        res = self.resources
        if self.pod_template and self.pod_template.wants_hugepages() and not {"cpu", "memory"} & {*res.requests, *res.limits}:
            raise ValueError(HUGEPAGES_MESSAGE)
        return self


# ---------------------------------------------------------------------------------------------
# Model, data set, workflow
# ---------------------------------------------------------------------------------------------

