"""Pure builders: RLExperiment -> the Kubernetes objects that run it (plain dicts, no client, no clock).

Called by the kopf handlers (O2), which adopt (owner references) and apply what these return, and by
tests that validate it offline. `build_children` gives every child in apply order.
"""

from __future__ import annotations

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.operator.builders.bus import (
    build_bus_secret,
    build_bus_services,
    build_bus_statefulset,
    build_bus_users_secret,
    render_nats_conf,
)
from kuberl.operator.builders.common import Obj, default_image
from kuberl.operator.builders.config import build_config_map, resolved_manifest
from kuberl.operator.builders.immutable import keep_immutable_fields
from kuberl.operator.builders.network import (
    build_network_policy,
    build_rollout_network_policy,
    build_trainer_network_policy,
)
from kuberl.operator.builders.rbac import build_rbac
from kuberl.operator.builders.rollout import (
    build_engine_secret,
    build_episode_secret,
    build_rollout_service,
    build_rollout_statefulset,
    rollout_replicas,
)
from kuberl.operator.builders.sandbox import (
    build_sandbox_children,
    build_sandbox_deployment,
    build_sandbox_network_policy,
    build_sandbox_service,
)
from kuberl.operator.builders.storage import (
    build_checkpoint_pvc,
    checkpoint_access_mode,
)
from kuberl.operator.builders.trainer import (
    build_trainer_job,
    build_trainer_pdb,
    build_trainer_service,
    trainer_command,
)

__all__ = [
    "build_bus_secret",
    "build_bus_users_secret",
    "build_bus_services",
    "build_bus_statefulset",
    "build_checkpoint_pvc",
    "build_children",
    "build_config_map",
    "build_engine_secret",
    "build_episode_secret",
    "build_network_policy",
    "build_rbac",
    "build_rollout_network_policy",
    "build_rollout_service",
    "build_rollout_statefulset",
    "build_sandbox_children",
    "build_sandbox_deployment",
    "build_sandbox_network_policy",
    "build_sandbox_service",
    "build_trainer_job",
    "build_trainer_network_policy",
    "build_trainer_pdb",
    "build_trainer_service",
    "checkpoint_access_mode",
    "default_image",
    "keep_immutable_fields",
    "render_nats_conf",
    "resolved_manifest",
    "rollout_replicas",
    "trainer_command",
]


def build_children(exp: RLExperiment, *, bus_token: str | None = None, rollout_replicas: int | None = None,
                   engine_api_key: str | None = None, bus_users: dict[str, str] | None = None,
                   episode_api_key: str | None = None) -> list[Obj]:
    """Every child of `exp`, in apply order (what others depend on first).

    Order: ServiceAccount, ConfigMap, bus Secret, checkpoint PVC, bus Services, bus NetworkPolicy, bus
    StatefulSet, with workflow.sandbox.placement pod the sandbox NetworkPolicy + Service + Deployment (before the
    rollout pods that call it), rollout Service + NetworkPolicy + StatefulSet, trainer Service + NetworkPolicy +
    PodDisruptionBudget + Job (each policy before the pods it guards). The bus Secret is included only when
    `bus_token` is given (embedded bus): the handlers generate the token once, create the Secret, and
    never rebuild it with a new token. The engine Secret (the engines' API key, read by the rollout pods)
    likewise comes only with `engine_api_key`, right before the rollout objects. `rollout_replicas` is
    the autoscaler's choice (default: the spec). `bus_users` (role -> .creds file, minted by the handlers on a
    shared external NATS with accountSigningKeySecret) gives the users Secret, likewise generated once. `episode_api_key`
    (workflow.external) gives the episode Secret, likewise, next to the engine Secret.
    """
    children: list[Obj] = [*build_rbac(exp), build_config_map(exp)]
    embedded = exp.spec.bus.external is None
    if embedded and bus_token is not None:
        children.append(build_bus_secret(exp, bus_token))
    if not embedded and bus_users is not None:
        children.append(build_bus_users_secret(exp, bus_users))
    pvc = build_checkpoint_pvc(exp)
    if pvc is not None:
        children.append(pvc)
    if embedded:
        children += build_bus_services(exp)
        policy = build_network_policy(exp)
        if policy is not None:
            children.append(policy)
        children.append(build_bus_statefulset(exp))
    if engine_api_key is not None:
        children.append(build_engine_secret(exp, engine_api_key))
    if episode_api_key is not None and exp.spec.workflow.external is not None:
        children.append(build_episode_secret(exp, episode_api_key))
    children += build_sandbox_children(exp)
    children += [build_rollout_service(exp), build_rollout_network_policy(exp), build_rollout_statefulset(exp, rollout_replicas)]
    children += [build_trainer_service(exp), build_trainer_network_policy(exp), build_trainer_pdb(exp), build_trainer_job(exp)]
    return children
