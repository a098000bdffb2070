"""`kuberl run FILE --ray ADDRESS|auto`: the same run as `kuberl run`, with its roles placed on a Ray cluster.

The manifest, the role commands, the bus and the fault handling are the local launcher's
(kuberl.runtime.launcher, kuberl.runtime.supervisor): only where a role process runs changes. Each
role process (the nats-server, `kuberl engine` and `kuberl rollout` per replica, `kuberl trainer` or
its torchrun) runs as a subprocess of a Ray actor of its own (RoleActor), which reports its exit; the
Supervisor restarts it per spec.failurePolicy exactly as it restarts a local process, in a new actor
when the old one (or its node) is gone.

Placement: each rollout replica gets a placement group of one bundle (its engine's CPUs and GPUs)
that holds both the engine and its agent (the agent reaches its engine on 127.0.0.1, as in a pod);
the trainer gets one bundle with one accelerator per rank (torchrun runs its ranks on one node);
the nats-server runs on the head node and every role gets its URL with the node IP Ray reports.
The workdir (manifest, model, weights, checkpoints, logs) must be a path every node sees (a shared
disk), as the roles of a cluster run share a volume.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuberl.api import RLExperiment
from kuberl.runtime.errors import CONFIG_ERROR_EXIT, TERMINATION_LOG_ENV
from kuberl.runtime.launcher import LocalRun, Role, _finish, _prepare, _supervise
from kuberl.runtime.lifetime import STOP_GRACE_SECONDS, Lifeline
from kuberl.runtime.ray_placement import (
    TOKEN_ENV,
    RayLaunchError,
    bus_url,
    head_node_id,
    import_ray,
    ray_placements,
    ray_role_env,
    reachable,
)
from kuberl.runtime.supervisor import BUS_STOP_SECONDS, describe_exit, say

PLACEMENT_TIMEOUT = 120.0
"""Seconds to wait for the cluster to reserve a role's resources before the run stops naming them."""
CALL_TIMEOUT = 60.0
"""Longest wait for one call to a role's actor (start, poll); a poll past it counts the role as alive."""
BUS_READY_SECONDS = 30.0
# -- the actor that runs one role process on its node ----------------------------------------------


class RoleActor:
    """Runs one role's command as a subprocess (its own process group) on the node Ray placed it on.

    The role's life hangs on the actor's (kuberl.runtime.lifetime.Lifeline): however the actor ends (ray.kill, its
    driver gone, its worker killed), the role and everything it started end with it."""

    def __init__(self) -> None:
        import atexit

        self.proc: subprocess.Popen | None = None
        self.lifeline = Lifeline()
        self.ports: list[socket.socket] = []  # held for the actor's life: its role's restarts find their port free
        atexit.register(self.reap)  # an actor that exits (its driver gone) takes its role process with it

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def reserve_port(self) -> int:
        """A port on this node held for this actor's role while the actor lives (kuberl.net.reserve_port)."""
        from kuberl.net import reserve_port

        self.ports.append(reserve_port())
        return self.ports[-1].getsockname()[1]

    def start(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str | None) -> int:
        """Start the command (argv[0], the driver's Python, becomes this node's); returns its pid."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **env, **self.lifeline.env()}
        with open(log_path, "ab") as out:
            out.write(f"\n==> {time.strftime('%H:%M:%S')} {' '.join(argv)} (Ray node {self.node_ip()})\n".encode())
            out.flush()
            self.proc = subprocess.Popen([sys.executable, *argv[1:]], env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=cwd if cwd and os.path.isdir(cwd) else None, **self.lifeline.popen_kwargs())
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout) if self.proc is not None else None
        except subprocess.TimeoutExpired:
            return None

    def reap(self) -> None:
        if self.proc is not None:
            _killpg(self.proc.pid, 9)

    def stop(self, grace: float) -> int | None:
        """SIGTERM the group, SIGKILL what is left after `grace` seconds."""
        if self.proc is None:
            return None
        _killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _killpg(self.proc.pid, 9)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class RayRole(Role):
    """A role whose process runs under a RoleActor; the Supervisor drives it like a local Role."""

    options: dict[str, Any] = field(default_factory=dict)  # ray.remote options: resources, placement
    cwd: str | None = None
    actor: Any = None
    pid: int | None = None
    code: int | None = None

    def new_actor(self) -> Any:
        import ray

        self.actor = ray.remote(RoleActor).options(name=None, max_restarts=0, **self.options).remote()
        return self.actor

    def start(self) -> None:
        import ray

        if self.termination_log is not None:
            self.termination_log.unlink(missing_ok=True)  # a message is about the latest run only
        if self.actor is None:
            self.new_actor()
        self.code = None
        self.pid = ray.get(self.actor.start.remote(self.argv, self.env, str(self.log_path), self.cwd), timeout=PLACEMENT_TIMEOUT)

    @property
    def started(self) -> bool:
        return self.pid is not None

    def alive(self) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if self.actor is None or self.pid is None:
            return False
        if self.code is not None:
            return False
        try:
            self.code = ray.get(self.actor.poll.remote(), timeout=CALL_TIMEOUT)
        except GetTimeoutError:
            return True  # a busy node: ask again on the next check
        except RayActorError:  # the actor or its node is gone: its process with it
            say(f"{self.name}: its Ray actor is gone (node lost or actor killed); a new one takes its place")
            self.actor, self.code = None, -9
        return self.code is None

    def exit_code(self) -> int | None:
        return self.code

    def reap(self) -> None:
        if self.actor is not None:
            try:
                self.actor.reap.remote()
            except Exception:  # the actor is gone: so is its process
                self.actor = None

    def wait(self, timeout: float) -> None:
        import ray

        if self.actor is None:
            return
        self.code = ray.get(self.actor.wait.remote(timeout), timeout=timeout + CALL_TIMEOUT)
        if self.code is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)

    def stop(self, grace: float = 10.0) -> None:
        import ray

        if self.actor is None:
            return
        try:
            ray.get(self.actor.stop.remote(grace), timeout=grace + CALL_TIMEOUT)
        except Exception as exc:  # a dead actor has nothing left to stop
            say(f"{self.name}: stopping its actor: {type(exc).__name__}")
        ray.kill(self.actor)
        self.actor = None


class RayBus:
    """The run's nats-server as a role (`kuberl bus`) on the head node: the Supervisor's bus interface."""

    name = "nats-server"

    def __init__(self, role: RayRole, port: int, store_dir: str) -> None:
        self.role = role
        self.port = port
        self.store_dir = store_dir
        self.log_path = role.log_path
        self.host = ""
        self.restarts = 0
        self.last_error = ""
        self.server = self  # the Supervisor reads server.pid, server.store_dir, server.log_path

    @property
    def pid(self) -> int | None:
        return self.role.pid

    @property
    def url(self) -> str:
        return bus_url(self.host, self.port)

    @property
    def returncode(self) -> int | None:
        return self.role.exit_code()

    def alive(self) -> bool:
        return self.role.alive()

    def start(self) -> bool:
        import ray

        if self.role.actor is None:
            self.role.new_actor()
        self.host = ray.get(self.role.actor.node_ip.remote(), timeout=PLACEMENT_TIMEOUT)
        self.role.start()
        deadline = time.monotonic() + BUS_READY_SECONDS
        while time.monotonic() < deadline:
            if not self.role.alive():
                self.last_error = f"kuberl bus {describe_exit(self.role.exit_code())}; see {self.log_path}"
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return True
            except OSError:
                time.sleep(0.3)
        self.last_error = f"nats-server did not listen on {self.host}:{self.port} within {BUS_READY_SECONDS:.0f}s; see {self.log_path}"
        return False

    def restart(self) -> bool:
        self.role.reap()
        if self.start():
            self.restarts += 1
            return True
        return False

    def stop(self) -> None:
        self.role.stop(grace=BUS_STOP_SECONDS)


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class RayRun(LocalRun):
    """LocalRun's roles (same commands), placed on a Ray cluster."""

    token: str | None = None
    groups: list[Any] = field(default_factory=list)  # placement groups, removed at the end

    def role_env(self, role: str, **extra: str) -> dict[str, str]:
        # Only the run's own variables: the rest comes from the node the role lands on.
        env = {"KUBERL_BUS_URL": self.bus_url, "KUBERL_WORKDIR": str(self.workdir), "PYTHONUNBUFFERED": "1",
               TERMINATION_LOG_ENV: str(self.workdir / "logs" / f"{role}.termination-log")}
        env.update(extra)
        return env

    def place(self) -> None:
        """Plan the roles as LocalRun does, then reserve their resources (placement groups) and make them RayRoles."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placements = ray_placements(self.exp)
        self.plan(gpus=1 << 20)  # devices come from Ray, not from this machine's count
        cwd = os.getcwd()
        groups: dict[str, Any] = {}
        for name in [r.name for r in self.roles if r.name.startswith("engine-")] + ["trainer"]:
            bundle = placements[name].bundle() or {"CPU": 0.01}
            pg = placement_group([bundle], strategy="STRICT_PACK", name=f"kuberl-{self.exp.name}-{name}")
            self.groups.append(pg)
            groups[name] = (pg, bundle)
        for pg, bundle in groups.values():
            self._wait_placed(pg, bundle, groups)
        roles = []
        for role in self.roles:
            p = placements[role.name]
            owner = "engine-" + role.name.split("-", 1)[1] if role.name.startswith("rollout-") else role.name
            strategy = PlacementGroupSchedulingStrategy(placement_group=groups[owner][0], placement_group_bundle_index=0)
            options = {**p.actor_options(), "scheduling_strategy": strategy}
            roles.append(RayRole(role.name, role.argv, ray_role_env(role.env, p, self.token), role.log_path, options=options, cwd=cwd))
        self.roles = roles

    def _wait_placed(self, pg: Any, bundle: dict[str, float], groups: dict[str, Any]) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT)
        except GetTimeoutError:
            wants = {name: b for name, (_, b) in groups.items()}
            raise RayLaunchError(f"the Ray cluster could not reserve {bundle} within {PLACEMENT_TIMEOUT:.0f}s; the run asks for {wants} "
                                 f"(one bundle per engine and one for the trainer), the cluster has {ray.cluster_resources()} "
                                 f"({ray.available_resources()} free): add nodes or lower the manifest's CPU requests and accelerator counts") from None

    def start_roles(self) -> None:
        """Start every role: each engine on a port free on its own node, its agent pointed at it."""
        import ray

        by_name = {r.name: r for r in self.roles}
        for role in self.roles:
            if role.name.startswith("engine-"):
                actor = role.new_actor()
                port = ray.get(actor.reserve_port.remote(), timeout=PLACEMENT_TIMEOUT)
                role.argv[role.argv.index("--port") + 1] = str(port)
                by_name["rollout-" + role.name.split("-", 1)[1]].env["KUBERL_ENGINE_URL"] = f"http://127.0.0.1:{port}"
        for role in self.roles:
            role.start()

    def stop_all(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Stop every role's actor at once (SIGTERM, SIGKILL after `grace` seconds, sooner if `hurry` is set), then kill
        the actors: a role still there dies with its actor (RoleActor)."""
        import ray

        held = [r for r in self.roles if isinstance(r, RayRole) and r.actor is not None]
        pending = [r.actor.stop.remote(grace) for r in held]
        deadline = time.monotonic() + grace + 5.0  # + the calls' own latency
        while pending and not self.hurry and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
        for role in held:
            ray.kill(role.actor)
            role.actor = None
        for port in self.ports:
            port.close()

    def remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            try:
                remove_placement_group(pg)
            except Exception:  # the cluster is going away: nothing left to free
                pass
        self.groups.clear()


def _start_bus(exp: RLExperiment, workdir: Path, token: str) -> RayBus:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=head_node_id(ray.nodes()), soft=False)
    store = str(workdir / "jetstream")
    probe = RayRole("nats-server", [], {}, workdir / "logs" / "nats-server.log", options={"num_cpus": 0, "scheduling_strategy": strategy})
    port = ray.get(probe.new_actor().reserve_port.remote(), timeout=PLACEMENT_TIMEOUT)
    probe.argv = [sys.executable, "-m", "kuberl.cli", "bus", "--port", str(port), "--store-dir", store, "--max-payload", "8MB"]
    probe.env = {TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    bus = RayBus(probe, port, store)
    if not bus.start():
        bus.stop()
        raise RayLaunchError(f"the run's nats-server would not start on the head node: {bus.last_error}")
    print(f"kuberl run: nats-server (JetStream) at {bus.url} on the Ray head node")
    return bus


def main(args) -> int:
    """`kuberl run FILE --ray ADDRESS`: the launcher's main, with placement on Ray."""
    try:
        ray = import_ray()
    except RayLaunchError as exc:
        print(f"kuberl run: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        reachable(args.ray)
    except (ConnectionError, ValueError) as exc:
        print(f"kuberl run: cannot reach the Ray cluster at --ray {args.ray}: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    prepared = _prepare(args)
    if isinstance(prepared, int):
        return prepared
    exp, manifest, workdir = prepared
    try:
        ray_placements(exp)  # a manifest Ray cannot place stops before anything connects
    except RayLaunchError as exc:
        print(f"kuberl run: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        ray.init(address=args.ray, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, ValueError, RuntimeError) as exc:
        print(f"kuberl run: cannot reach the Ray cluster at --ray {args.ray}: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    bus = None
    run = None
    try:
        bus_url_arg = args.bus_url or (exp.spec.bus.external.url if exp.spec.bus.external is not None else None)
        token = None
        if bus_url_arg is None:
            token = secrets.token_hex(16)  # the bus listens on every interface of its node: clients must present it
            os.environ[TOKEN_ENV] = token  # the progress reader in this process
            bus = _start_bus(exp, workdir, token)
            bus_url_arg = bus.url
        run = RayRun(exp, manifest, workdir, bus_url_arg, token=token)
        run.place()
        run.start_roles()
        from kuberl.runtime.supervisor import Supervisor

        supervisor = run.supervisor = Supervisor(run, bus)
        print(f"kuberl run: started {', '.join(r.name for r in run.roles)} on Ray ({args.ray}); logs in {workdir / 'logs'}")
        report, failure, interrupted = _supervise(run, supervisor, bus, workdir)
        return _finish(run, workdir, report, failure, interrupted)
    except RayLaunchError as exc:
        print(f"kuberl run: {exc}", file=sys.stderr)
        return 1
    finally:
        if run is not None:
            run.stop_all()  # what _supervise has not stopped (a start that failed): nothing when it has
            run.remove_groups()
        if bus is not None and bus.role.actor is not None:
            bus.stop()
        ray.shutdown()
