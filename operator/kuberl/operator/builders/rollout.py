"""The rollout StatefulSet (engine + rollout-agent pods) and its headless Service.

Called by builders.build_children and by the kopf handlers (O2), which pass the autoscaler's replica
count. Commands, env and paths follow docs/design/contracts.md.
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
    secret_env,
    with_spec_hash,
)
from kuberl.operator.builders.pod import runtime_container, runtime_pod_template
from kuberl.operator.builders.sandbox import sandbox_env

# The operator never imports the runtime: these name the env vars that kuberl.runtime.inference.engine_auth
# (API_KEY_ENV) and kuberl.runtime.rollout.health (HEALTH_PORT_ENV) read; tests/unit/test_rollout_pod_security.py
# checks they agree.
API_KEY_ENV = "KUBERL_ENGINE_API_KEY"
HEALTH_PORT_ENV = "KUBERL_AGENT_HEALTH_PORT"
# ... and those kuberl.runtime.rollout.episode_api reads (workflow.external).
EPISODE_PORT_ENV = "KUBERL_EPISODE_PORT"
EPISODE_LISTEN_ENV = "KUBERL_EPISODE_LISTEN"
EPISODE_ADVERTISE_ENV = "KUBERL_EPISODE_ADVERTISE"
EPISODE_KEY_ENV = "KUBERL_EPISODE_API_KEY"

ENGINE_CONTAINER = "engine"
AGENT_CONTAINER = "rollout-agent"
# The agent tokenizes, scores rewards and talks to the bus: light next to the engine.
AGENT_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}}
# Loading a large model (download + weights + CUDA graphs) can take many minutes: 30 min before a restart.
ENGINE_STARTUP_SECONDS = 1800
ENGINE_API_KEY_KEY = "apiKey"  # the key of the engine Secret's value


def agent_probes() -> Obj:
    """The agent's port and probes (runtime/rollout/health.py): liveness restarts an agent whose loop
    stalled or blocked; readiness holds while its bus is down or its engine does not answer (the
    readiness handler waits up to 5 s for the engine's /health). The same port serves /metrics (kuberl.runtime.prom):
    the chart's PodMonitor scrapes it by its name, `probes`."""
    def get(path: str) -> Obj:
        return {"httpGet": {"path": path, "port": "probes"}, "timeoutSeconds": 10}

    return {
        "ports": [{"name": "probes", "containerPort": naming.AGENT_HEALTH_PORT, "protocol": "TCP"}],
        "startupProbe": {**get("/healthz"), "periodSeconds": 5, "failureThreshold": 60},
        "readinessProbe": {**get("/readyz"), "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**get("/healthz"), "periodSeconds": 30, "failureThreshold": 3},
    }


def _key_secret(exp: RLExperiment, name: str, what: str, api_key: str) -> Obj:
    """An Opaque Secret holding one API key under `apiKey` (pods read it through secretKeyRef, never literally)."""
    if not api_key or any(c.isspace() for c in api_key):
        raise ValueError(f"{what} API key must be a non-empty string without whitespace")
    return pinning.stamp({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(exp, name, L.Component.ROLLOUT),
        "type": "Opaque",
        "stringData": {ENGINE_API_KEY_KEY: api_key},
    }, exp)


def build_engine_secret(exp: RLExperiment, api_key: str) -> Obj:
    """Secret `{exp}-engine-credentials`: key `apiKey`, the engines' API key (runtime.inference.engine_auth).
    The handlers generate it once and keep it."""
    return _key_secret(exp, naming.engine_secret_name(exp), "engine", api_key)


def build_episode_secret(exp: RLExperiment, api_key: str) -> Obj:
    """Secret `{exp}-episode-api`: key `apiKey`, the experiment's episode key (workflow.external). Generated once and kept
    by the handlers; the rollout agents read it through secretKeyRef; users read it to start their external agents."""
    return _key_secret(exp, naming.episode_secret_name(exp), "episode", api_key)


def episode_api(exp: RLExperiment) -> tuple[list[Obj], list[Obj]]:
    """workflow.external: the agent's env (the episode port on every address, the pod's IP for the base URLs it hands out,
    the key from the episode Secret) and its `episodes` port; nothing without it."""
    if exp.spec.workflow.external is None:
        return [], []
    env = [
        {"name": EPISODE_PORT_ENV, "value": str(naming.EPISODE_PORT)},
        {"name": EPISODE_LISTEN_ENV, "value": "0.0.0.0"},
        {"name": EPISODE_ADVERTISE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        secret_env(EPISODE_KEY_ENV, naming.episode_secret_name(exp), ENGINE_API_KEY_KEY),
    ]
    return env, [{"name": "episodes", "containerPort": naming.EPISODE_PORT, "protocol": "TCP"}]


def engine_key_env(exp: RLExperiment) -> Obj:
    """$KUBERL_ENGINE_API_KEY from the engine Secret: the engine asks for it, the agent sends it."""
    return secret_env(API_KEY_ENV, naming.engine_secret_name(exp), ENGINE_API_KEY_KEY)


def rollout_replicas(exp: RLExperiment, replicas: int | None = None) -> int:
    """Replicas the StatefulSet gets: 0 when suspended, else the autoscaler's choice, else spec.rollout.replicas."""
    if exp.spec.suspend:
        return 0
    if replicas is None:
        return exp.spec.rollout.replicas
    if replicas < 0:
        raise ValueError(f"rollout replicas must be >= 0, got {replicas}")
    return replicas


def workdir_read_only(exp: RLExperiment) -> bool:
    """Whether the rollout pods see KUBERL_WORKDIR read-only: yes for disk sync (the trainer writes the
    weights, engines only read), except with model.builtin, which every role builds into
    `$KUBERL_WORKDIR/models` (runtime/models.py) and so must be able to write there."""
    return exp.spec.weight_sync.mode == "disk" and exp.spec.model.builtin is None


def _workdir_volume(exp: RLExperiment) -> Obj:
    """disk sync: the checkpoint PVC (the trainer writes weights there, engines read them).
    bus sync: a pod-local emptyDir where the agent puts downloaded weights for its engine."""
    if exp.spec.weight_sync.mode == "disk":
        claim: Obj = {"claimName": naming.checkpoint_claim_name(exp)}
        if workdir_read_only(exp):
            claim["readOnly"] = True
        return {"name": "workdir", "persistentVolumeClaim": claim}
    return {"name": "workdir", "emptyDir": {}}


def build_rollout_statefulset(exp: RLExperiment, replicas: int | None = None) -> Obj:
    """StatefulSet `{exp}-rollout`; `replicas` (the autoscaler's choice) overrides spec.rollout.replicas."""
    spec = exp.spec.rollout
    name = naming.rollout_name(exp)
    env = runtime_env(exp, bus_auth.ROLLOUT)
    data_vols, data_mounts = data_volumes(exp)
    read_only = workdir_read_only(exp)
    health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    episode_env, episode_ports = episode_api(exp)
    probes = agent_probes()
    engine = runtime_container(
        exp, spec, spec.accelerator,
        name=ENGINE_CONTAINER,
        command=["kuberl", "engine", "--config", CONFIG_PATH, "--port", str(naming.ENGINE_PORT)],
        env=[*env, engine_key_env(exp)],
        # The engine reads new weights from the workdir (and builds a builtin model there).
        mounts=[{"name": "workdir", "mountPath": WORKDIR, "readOnly": read_only}, *data_mounts],
        resources=container_resources(spec, spec.accelerator),
        ports=[{"name": "http", "containerPort": naming.ENGINE_PORT, "protocol": "TCP"}],
        startupProbe={**health, "periodSeconds": 10, "failureThreshold": ENGINE_STARTUP_SECONDS // 10},
        readinessProbe={**health, "periodSeconds": 10, "failureThreshold": 3},
        livenessProbe={**health, "periodSeconds": 30, "failureThreshold": 5},
    )
    agent = runtime_container(
        exp, spec, spec.accelerator,
        name=AGENT_CONTAINER,
        command=["kuberl", "rollout", "--config", CONFIG_PATH],
        env=[
            *env,
            {"name": "KUBERL_ENGINE_URL", "value": f"http://127.0.0.1:{naming.ENGINE_PORT}"},
            {"name": "KUBERL_AGENT_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            engine_key_env(exp),
            {"name": HEALTH_PORT_ENV, "value": str(naming.AGENT_HEALTH_PORT)},
            *episode_env,
            *sandbox_env(exp),  # workflow.sandbox.placement pod: where tool calls go
        ],
        # disk: read-only view of the trainer's weights; bus: the agent writes downloaded weights.
        mounts=[{"name": "workdir", "mountPath": WORKDIR, "readOnly": read_only}, *data_mounts],
        resources=AGENT_RESOURCES,
        shm=False,
        **{**probes, "ports": [*probes["ports"], *episode_ports]},
    )
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(exp, name, L.Component.ROLLOUT),
        "spec": {
            "replicas": rollout_replicas(exp, replicas),
            "serviceName": name,
            # Replicas are interchangeable; start and stop them all at once when scaling.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": L.selector_labels(exp, L.Role.ROLLOUT)},
            "template": runtime_pod_template(
                exp, L.Component.ROLLOUT, spec, spec.accelerator, default_container=AGENT_CONTAINER,
                containers=[engine, agent], volumes=[_workdir_volume(exp), *data_vols],
            ),
        },
    }
    return with_spec_hash(pinning.stamp(sts, exp))


def build_rollout_service(exp: RLExperiment) -> Obj:
    """Headless Service `{exp}-rollout`: stable DNS for each engine pod (the StatefulSet's serviceName); workflow.external:
    its `episodes` port too (the name resolves to every ready rollout pod; each hands out base URLs naming itself)."""
    ports = {"http": naming.ENGINE_PORT} | ({"episodes": naming.EPISODE_PORT} if exp.spec.workflow.external is not None else {})
    return headless_service(exp, naming.rollout_name(exp), L.Component.ROLLOUT, L.Role.ROLLOUT, ports)
