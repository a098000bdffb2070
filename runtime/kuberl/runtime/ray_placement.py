"""What `kuberl run --ray` asks of a Ray cluster, as pure functions: resources and placement-group
bundles per role, the bus URL per node, each role's environment, the head node, a reachable address.
Ray is imported only by import_ray (kuberl.runtime.ray_launcher does the placing)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from kuberl.api import RLExperiment
from kuberl.runtime.resources import COMPUTE_CPUS_ENV, CPUS_ENV, THREADS_ENV, cpu_quantity

TOKEN_ENV = "KUBERL_BUS_TOKEN"
RAY_INSTALL = "pip install 'kuberl-runtime[ray]'  (or: pip install 'ray>=2.60,<2.61')"
RAY_RESOURCE = {"nvidia": "GPU", "ascend": "NPU"}
"""Ray's resource name for each accelerator type of the manifest (cpu: none)."""


class RayLaunchError(RuntimeError):
    """A run that cannot be placed on the cluster (the message says what to change)."""


def import_ray() -> Any:
    """The ray module, or RayLaunchError naming the pip command when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise RayLaunchError(f"--ray needs Ray, which is not installed here: {RAY_INSTALL}") from None
    return ray


# -- what each role asks of the cluster (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """The Ray resources of one role process and the compute threads of each of its processes."""

    num_cpus: float
    accelerators: int = 0
    accelerator: str = ""  # Ray resource name: GPU, NPU ("" = none)
    threads: int = 1

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle reserving this role's resources."""
        out = {"CPU": float(self.num_cpus)} if self.num_cpus > 0 else {}
        if self.accelerators:
            out[self.accelerator] = float(self.accelerators)
        return out

    def actor_options(self) -> dict[str, Any]:
        """ray.remote options of the role's actor (Ray sets CUDA_VISIBLE_DEVICES for the GPUs it grants)."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": 0}
        if self.accelerator == "GPU":
            opts["num_gpus"] = self.accelerators
        elif self.accelerators:
            opts["resources"] = {self.accelerator: self.accelerators}
        return opts


def _cpu_request(block: Any, field_name: str) -> float | None:
    res = block.resources
    value = res.requests.get("cpu") or res.limits.get("cpu")
    try:
        return cpu_quantity(value)
    except ValueError as exc:
        raise RayLaunchError(f"{field_name}.resources: {exc}") from None


def ray_placements(exp: RLExperiment) -> dict[str, Placement]:
    """Resources per role process: engine-i, rollout-i (the agent, sharing its engine's bundle) and trainer.

    CPUs: the role's CPU request (else limit; else 1 per engine and 1 per trainer rank). Accelerators:
    rollout.accelerator.count per engine, trainer.accelerator.count for the trainer's torchrun.
    """
    spec = exp.spec
    if spec.trainer.nodes != 1:
        raise RayLaunchError(f"trainer.nodes is {spec.trainer.nodes}: --ray runs the trainer's ranks on one node (torchrun); "
                             "use trainer.nodes: 1 with accelerator.count ranks, or the operator on Kubernetes for several nodes")
    out: dict[str, Placement] = {}
    r_acc = spec.rollout.accelerator
    r_name = RAY_RESOURCE.get(str(r_acc.type), "")
    r_count = r_acc.count if r_name else 0
    r_cpus = _cpu_request(spec.rollout, "rollout") or 1.0
    for i in range(spec.rollout.replicas):
        out[f"engine-{i}"] = Placement(r_cpus, r_count, r_name, threads=max(1, int(r_cpus)))
        out[f"rollout-{i}"] = Placement(0, 0, "", threads=1)  # waits on its engine and the bus
    t_acc = spec.trainer.accelerator
    t_name = RAY_RESOURCE.get(str(t_acc.type), "")
    nproc = max(t_acc.count, 1)
    t_cpus = _cpu_request(spec.trainer, "trainer") or float(nproc)
    out["trainer"] = Placement(t_cpus, t_acc.count if t_name else 0, t_name, threads=max(1, int(t_cpus) // nproc))
    return out


def bus_url(node_ip: str, port: int) -> str:
    """The URL every role uses for the run's nats-server: the address of the node Ray placed it on."""
    if not node_ip:
        raise RayLaunchError("Ray reported no address for the bus's node")
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    return f"nats://{host}:{port}"


def ray_role_env(base: dict[str, str], placement: Placement, token: str | None) -> dict[str, str]:
    """A role's environment on its node: the run's variables, its thread count, the bus token; never the
    driver's cores (KUBERL_CPUS) or devices (Ray gives the actor its own CUDA_VISIBLE_DEVICES)."""
    env = {k: v for k, v in base.items() if k not in (CPUS_ENV, COMPUTE_CPUS_ENV, "CUDA_VISIBLE_DEVICES")}
    env[THREADS_ENV] = str(placement.threads)
    if token:
        env[TOKEN_ENV] = token
    return env


def head_node_id(nodes: list[dict]) -> str:
    """The head node's id among ray.nodes() (where the nats-server runs)."""
    for n in nodes:
        if n.get("Alive") and "node:__internal_head__" in (n.get("Resources") or {}):
            return n["NodeID"]
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise RayLaunchError("the Ray cluster reports no live node")
    return alive[0]["NodeID"]


def reachable(address: str, timeout: float = 5.0) -> None:
    """ConnectionError unless HOST:PORT (the cluster's GCS) accepts connections: ray.init would retry for minutes.
    "auto" and ray:// addresses are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 10.0.0.5:6379) or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc.strerror or exc}); start the cluster (ray start --head) "
                              "or pass its address") from None
