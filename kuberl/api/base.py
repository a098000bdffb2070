"""The building blocks of the RLExperiment API: group/version constants, KubeModel (camelCase, CEL rules),
quantities, Secret and volume references, resources and accelerators."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kuberl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLExperiment"
PLURAL = "rlexperiments"
SINGULAR = "rlexperiment"
SHORT_NAMES = ["rlx"]
CATEGORIES = ["kuberl"]

# Kubernetes resource.Quantity, as the API server parses it (apimachinery/pkg/api/resource).
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
# AReaL's allocation grammar: "<engine>:<dims>+<backend>:<dims>", dims like d4, d2t2, d2p2t2c1e1.
ALLOCATION_PATTERN = r"^(sglang|vllm):([dtp][0-9]+)+\+(fsdp|megatron):([dtpce][0-9]+)+$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# An RLExperiment's name prefixes its Services' names, and Service names are DNS-1035 labels: a letter first
# (KubeRay asks the same of a RayCluster's name).
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

Quantity = Annotated[
    int | str,
    Field(
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN},
        union_mode="left_to_right",
    ),
]


class FieldError(ValueError):
    """A rejected value with the manifest path it sits at (`spec.rollout.replicas`), for error reports."""

    def __init__(self, path: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.value = value


def _check_quantity(value: int | str, path: str) -> None:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{path}: {value!r} is not a Kubernetes quantity (e.g. 10Gi, 500m, 2)")


class KubeModel(BaseModel):
    """Base of every API model: camelCase in manifests, unknown fields rejected (as admission does)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True
    )

    def to_manifest(self) -> dict[str, Any]:
        """The manifest form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _cel(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Attach CEL rules (rule, message[, fieldPath]) to a model's schema as x-kubernetes-validations.

    fieldPath (relative to the model, e.g. `.rollout.accelerator.count`) is where the API server
    reports a failure; rules that need fields of several blocks live on the parent and point down.
    """
    out = []
    for rule, msg, *field_path in rules:
        out.append({"rule": rule, "message": msg} | ({"fieldPath": field_path[0]} if field_path else {}))
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": out})


def _or(path: str, default: int | str) -> str:
    """CEL for `path` or its default when absent (fields the allocation shorthand fills have no CRD default)."""
    fallback = f"'{default}'" if isinstance(default, str) else str(default)
    return f"(has({path}) ? {path} : {fallback})"


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class SecretKeyRef(KubeModel):
    """A key of a Secret in the experiment's namespace. Its value never lands in a ConfigMap."""

    name: str = Field(description="Name of the Secret.", min_length=1, pattern=DNS1123_LABEL.replace("[-a-z0-9]", "[-.a-z0-9]"))
    key: str = Field("token", description="Key inside the Secret.", min_length=1)


class VolumeRef(KubeModel):
    """A PersistentVolumeClaim that holds a model or a data set, mounted read-only."""

    claim_name: str = Field(description="Name of an existing PersistentVolumeClaim.", min_length=1)
    sub_path: str = Field("", description="Folder inside the claim to mount (empty = the root).")


class ResourceRequirements(KubeModel):
    """Container resources, as in a Pod spec (accelerators are set by `accelerator`, not here)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}.")
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16, description="Maximum resources.")

    @model_validator(mode="after")
    def _quantities(self) -> ResourceRequirements:
        for part in ("requests", "limits"):
            for name, value in getattr(self, part).items():
                _check_quantity(value, f"{part}.{name}")
        return self


class AcceleratorType(StrEnum):
    """Which accelerator a pod asks for; the operator maps it to a resource name."""

    NVIDIA = "nvidia"  # nvidia.com/gpu
    ASCEND = "ascend"  # huawei.com/Ascend910, with the NPU image
    CPU = "cpu"  # no device: count = processes (trainer) or nothing (rollout)


ACCELERATOR_RESOURCE = {AcceleratorType.NVIDIA: "nvidia.com/gpu", AcceleratorType.ASCEND: "huawei.com/Ascend910"}


class AcceleratorSpec(KubeModel):
    type: AcceleratorType = Field(AcceleratorType.NVIDIA, description="nvidia (nvidia.com/gpu), ascend (huawei.com/Ascend910) or cpu.")
    count: int = Field(
        1, ge=0, le=64,
        description="Accelerators per pod (rollout replica or trainer node). Default: from `allocation` when set, "
                    "else rollout tensorParallelSize * pipelineParallelSize, trainer 1.",
    )


