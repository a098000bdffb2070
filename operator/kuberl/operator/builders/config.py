"""The experiment ConfigMap: `experiment.yaml`, the resolved manifest every runtime role loads.

Called by builders.build_children and the kopf handlers (O2). Pods mount it at /etc/kuberl.
"""

from __future__ import annotations

from typing import Any

import yaml

from kuberl.api.v1alpha1 import API_VERSION, KIND, RLExperiment
from kuberl.operator import labels as L
from kuberl.operator import naming
from kuberl.operator.builders import pinning
from kuberl.operator.builders.common import (
    CONFIG_KEY,
    DATASETS_DIR,
    MODELS_DIR,
    Obj,
    metadata,
    stable_hash,
    with_spec_hash,
)

# Fields only the operator acts on: how many pods, where they run, how the bus and PVC are made,
# suspension and restarts. They are left out of experiment.yaml so that changing them (kubectl scale,
# a new toleration, suspend) neither rewrites the file nor rolls the pods that read it; the pods get
# their effect through the objects the operator renders instead. `allocation` is left out because it
# is already expanded into the rollout and trainer fields.
_SCHEDULING = ("replicas", "autoscaling", "image", "imagePullPolicy", "resources", "nodeSelector", "tolerations", "affinity", "priorityClassName",
               "podTemplate")
OPERATOR_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "": ("allocation", "suspend", "ttlSecondsAfterFinished", "failurePolicy", "managedBy"),
    "rollout": _SCHEDULING,
    "trainer": tuple(f for f in _SCHEDULING if f not in ("replicas", "autoscaling")),
    "bus": ("embedded",),
    "checkpoint": ("size", "storageClassName", "existingClaim"),
}

_HEADER = (
    "# Resolved by the KubeRL operator from RLExperiment {ns}/{name}: allocation expanded, volume paths\n"
    "# made absolute (model.volume -> {models}/<claim>, dataset.volume -> {datasets}/<claim>), and the\n"
    "# operator-only fields (replicas, autoscaling, scheduling, bus.embedded, checkpoint volume, suspend,\n"
    "# failurePolicy) left out: pods do not act on them. Nothing secret lives here.\n"
)


def resolved_manifest(exp: RLExperiment) -> dict[str, Any]:
    """apiVersion/kind/metadata(name, namespace)/spec as the pods see it (see OPERATOR_ONLY_FIELDS)."""
    spec = exp.spec.to_manifest()
    for section, fields in OPERATOR_ONLY_FIELDS.items():
        target = spec if not section else spec.get(section, {})
        for field in fields:
            target.pop(field, None)
    # In a pod a volume-backed path is just a local path under the mount, so the runtime needs no
    # knowledge of claims: model.path = /models/<claim>/<path>.
    for key, root in (("model", MODELS_DIR), ("dataset", DATASETS_DIR)):
        volume = spec[key].pop("volume", None)
        if volume is not None:
            spec[key]["path"] = f"{root}/{volume['claimName']}/{spec[key]['path'].lstrip('/')}"
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": exp.name, "namespace": exp.namespace}, "spec": spec}


def render_experiment_yaml(exp: RLExperiment) -> str:
    header = _HEADER.format(ns=exp.namespace, name=exp.name, models=MODELS_DIR, datasets=DATASETS_DIR)
    return header + yaml.safe_dump(resolved_manifest(exp), sort_keys=False, default_flow_style=False)


def config_hash(exp: RLExperiment) -> str:
    """Hash of experiment.yaml, stamped on the pod templates that mount it."""
    return stable_hash(render_experiment_yaml(exp))


def build_config_map(exp: RLExperiment) -> Obj:
    """ConfigMap `{exp}-config` with key experiment.yaml."""
    return with_spec_hash(pinning.stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": metadata(exp, naming.config_map_name(exp), L.Component.CONFIG),
            "data": {CONFIG_KEY: render_experiment_yaml(exp)},
        }, exp
    ))
