"""`kuberl run FILE`: the embedded default — one RLExperiment on this machine, no cluster.

Starts the same role processes the operator puts in pods (nats-server, `kuberl engine` + `kuberl
rollout` per rollout replica, `kuberl trainer`, torchrun when the trainer has several processes),
shows live progress read from the bus, restarts a crashed role per the failure policy, plots the
reward curve, and on the end of training, SIGTERM or Ctrl-C stops every process group it started (all at once:
SIGTERM, then SIGKILL after lifetime.STOP_GRACE_SECONDS); killed itself, it takes them along (kuberl.runtime.lifetime). A role that
exits 2 (a configuration error, contracts.md) is not restarted: the run stops at once and prints the
reason the role wrote to its termination message ($KUBERL_TERMINATION_LOG, logs/<role>.termination-log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kuberl.api import RLExperiment, load_experiment
from kuberl.net import reserve_port
from kuberl.runtime.errors import CONFIG_ERROR_EXIT, TERMINATION_LOG_ENV, ConfigError, spec_errors
from kuberl.runtime.launcher_progress import eval_text, fmt_number, plot_rewards, progress_info, watch_progress  # noqa: F401 (re-exported)
from kuberl.runtime.lifetime import STOP_GRACE_SECONDS, Lifeline
from kuberl.runtime.resources import available_cpus, plan_local_cpus
from kuberl.runtime.resources import role_env as role_cpu_env

log = logging.getLogger("kuberl.run")
stop_log = logging.getLogger("kuberl.run.stop")  # the launcher's log only (route_logs shows kuberl.run's own lines)
EPISODE_KEY_FILE = "episode-api.key"  # workflow.external: the run's episode key, in the workdir (owner-only)


@dataclass
class Role:
    """One role process (a session and process group of its own, so that engine children die with it)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    restartable: bool = True
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    done: bool = False
    lifeline: Lifeline | None = None  # ties the process to the launcher's life (kuberl.runtime.lifetime)

    @property
    def termination_log(self) -> Path | None:
        """Where the role writes the reason of a configuration error (its pod's termination message)."""
        path = self.env.get(TERMINATION_LOG_ENV)
        return Path(path) if path else None

    def termination_message(self) -> str:
        """The reason the role's last run wrote before exiting ("" when it wrote none)."""
        path = self.termination_log
        try:
            return path.read_text().strip() if path else ""
        except OSError:
            return ""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.termination_log is not None:
            self.termination_log.unlink(missing_ok=True)  # a message is about the latest run only
        out = open(self.log_path, "ab")
        out.write(f"\n==> {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
        out.flush()
        tie, env = ({"start_new_session": True}, self.env) if self.lifeline is None else \
            (self.lifeline.popen_kwargs(), {**self.env, **self.lifeline.env()})
        self.proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=subprocess.STDOUT, **tie)
        out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # What the supervisor asks of a role, wherever its process runs (here: a local process group;
    # kuberl.runtime.ray_launcher.RayRole: a process under a Ray actor on some node of the cluster).

    @property
    def started(self) -> bool:
        return self.proc is not None

    def exit_code(self) -> int | None:
        """The dead process's exit code (negative: the signal that killed it)."""
        return self.proc.returncode if self.proc is not None else None

    def reap(self) -> None:
        """Kill what is left of a dead role's process group (vLLM's engine core outlives its server)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> None:
        """Wait for the process to exit (subprocess.TimeoutExpired after `timeout` seconds)."""
        if self.proc is not None:
            self.proc.wait(timeout=timeout)

    def terminate(self) -> None:
        """SIGTERM the process group (the role stops in its own time: stop() bounds it)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process group (it may outlive its leader: vLLM's engine core) and reap the leader."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not exit after SIGKILL", self.name, self.proc.pid)

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `grace` seconds."""
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class LocalRun:
    """The processes of one local run, their restarts, and how they end."""

    exp: RLExperiment
    manifest: Path
    workdir: Path
    bus_url: str
    roles: list[Role] = field(default_factory=list)
    config_error: bool = False  # a role exited 2: the run failed on its configuration
    supervisor: Any = None  # kuberl.runtime.supervisor.Supervisor, made on the first supervise()
    # The engines' ports, held for the run's life (kuberl.net.reserve_port): an engine restarted on its port
    # finds it free, though other processes on the machine open and close ports all the time.
    ports: list[socket.socket] = field(default_factory=list)
    lifeline: Lifeline = field(default_factory=Lifeline)  # every role's life hangs on this process's (kuberl.runtime.lifetime)
    hurry: bool = False  # a second Ctrl-C or SIGTERM while stopping: SIGKILL what is left now
    episode_urls: list[str] = field(default_factory=list)  # workflow.external: each rollout agent's episode API

    def episode_env(self) -> dict[str, str]:
        """workflow.external: a port held for this replica's episode API (loopback) and the run's episode key file
        (made once, owner-only; kept on --resume): what the rollout agent serves with (episode_api.py)."""
        if self.exp.spec.workflow.external is None:
            return {}
        key_file = self.workdir / EPISODE_KEY_FILE
        if not key_file.is_file():
            key_file.touch(mode=0o600)
            key_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.ports.append(reserve_port())
        port = self.ports[-1].getsockname()[1]
        self.episode_urls.append(f"http://127.0.0.1:{port}/v1/episodes")
        return {"KUBERL_EPISODE_PORT": str(port), "KUBERL_EPISODE_API_KEY_FILE": str(key_file)}

    def announce_episode_api(self) -> None:
        """Print where external agents take episodes, and write it to <workdir>/episode-api.json for scripts."""
        if not self.episode_urls:
            return
        key_file = self.workdir / EPISODE_KEY_FILE
        (self.workdir / "episode-api.json").write_text(json.dumps({"urls": self.episode_urls, "key_file": str(key_file)}) + "\n")
        print(f"kuberl run: episode API for external agents at {', '.join(self.episode_urls)} (POST, Authorization: Bearer <key>); "
              f"key in {key_file}; both in {self.workdir / 'episode-api.json'}", flush=True)

    def role_env(self, role: str, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"KUBERL_BUS_URL": self.bus_url, "KUBERL_WORKDIR": str(self.workdir), "PYTHONUNBUFFERED": "1",
                    TERMINATION_LOG_ENV: str(self.workdir / "logs" / f"{role}.termination-log")})
        env.update(extra)
        return env

    def plan(self, gpus: int = 0) -> None:
        """The role processes: what the operator would render as pods, as local processes.

        With `gpus` local NVIDIA devices, each engine gets its own block of tp*pp devices and the trainer
        the next ones (CUDA_VISIBLE_DEVICES), as the scheduler would give each pod its own.
        """
        spec = self.exp.spec
        cli = [sys.executable, "-m", "kuberl.cli"]
        logs = self.workdir / "logs"
        devices = assign_gpus(self.exp, gpus)
        # Each role its own cores and thread counts (KUBERL_CPUS/KUBERL_THREADS, applied by the role's entry point).
        cores = plan_local_cpus(self.exp, available_cpus())
        devices = {role: {**role_cpu_env(c), **devices.get(role, {})} for role, c in cores.items()}
        for i in range(spec.rollout.replicas):
            self.ports.append(reserve_port())
            port = self.ports[-1].getsockname()[1]
            url = f"http://127.0.0.1:{port}"
            self.roles.append(Role(f"engine-{i}", [*cli, "engine", "--config", str(self.manifest), "--port", str(port), "--host", "127.0.0.1"],
                                   self.role_env(f"engine-{i}", **devices.get(f"engine-{i}", {})), logs / f"engine-{i}.log", lifeline=self.lifeline))
            self.roles.append(Role(f"rollout-{i}", [*cli, "rollout", "--config", str(self.manifest), "--bus-url", self.bus_url, "--workdir", str(self.workdir)],
                                   self.role_env(f"rollout-{i}", KUBERL_ENGINE_URL=url, KUBERL_AGENT_ID=f"{self.exp.name}-rollout-{i}",
                                                 **devices.get(f"rollout-{i}", {}), **self.episode_env()),
                                   logs / f"rollout-{i}.log", lifeline=self.lifeline))
        nproc = max(spec.trainer.accelerator.count, 1) * spec.trainer.nodes
        trainer_cmd = ["trainer", "--config", str(self.manifest), "--bus-url", self.bus_url, "--workdir", str(self.workdir)]
        if nproc > 1:
            # torchrun, passing a rank's exit code 2 on (plain torchrun turns every failure into 1).
            argv = [sys.executable, "-m", "kuberl.runtime.trainer.torchrun", "--standalone", f"--nproc-per-node={nproc}",
                    "-m", "kuberl.cli", *trainer_cmd]
        else:
            argv = [*cli, *trainer_cmd]
        self.roles.append(Role("trainer", argv, self.role_env("trainer", **devices.get("trainer", {})), logs / "trainer.log", lifeline=self.lifeline))

    def add_sandbox(self) -> None:
        """workflow.sandbox.placement pod: the sandbox server (kuberl.runtime.rollout.sandbox_server) as a role of its own on a
        loopback port held for the run, and every rollout agent pointed at it ($KUBERL_SANDBOX_URL): the path the
        operator's sandbox pods take, without a cluster. Its environment is a bare one, as a sandbox pod's: none of the
        launcher's (a hub token, bus credentials), so tool code it runs could not find them even outside its confinement."""
        if self.exp.spec.workflow.sandbox.placement != "pod":
            return
        from kuberl.runtime.rollout.sandbox_server import SANDBOX_URL_ENV

        self.ports.append(reserve_port())
        port = self.ports[-1].getsockname()[1]
        home = self.workdir / "sandbox"
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(home), "PYTHONUNBUFFERED": "1",
               TERMINATION_LOG_ENV: str(self.workdir / "logs" / "sandbox.termination-log")}
        if os.environ.get("PYTHONPATH"):  # where kuberl itself may come from
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        argv = [sys.executable, "-m", "kuberl.runtime.rollout.sandbox_server", "--host", "127.0.0.1", "--port", str(port)]
        self.roles.insert(0, Role("sandbox", argv, env, self.workdir / "logs" / "sandbox.log", lifeline=self.lifeline))
        for role in self.roles:
            if role.name.startswith("rollout-"):
                role.env[SANDBOX_URL_ENV] = f"http://127.0.0.1:{port}"

    @property
    def trainer(self) -> Role:
        return next(r for r in self.roles if r.name == "trainer")

    def supervise(self) -> str | None:
        """Restart roles that died (kuberl.runtime.supervisor); a failure line when the run must stop, at once
        when a role exits 2 (a configuration error: restarting cannot fix it; see config_error)."""
        from kuberl.runtime.supervisor import Supervisor

        if self.supervisor is None:
            self.supervisor = Supervisor(self)
        return self.supervisor.check()

    def stop_all(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every role at once, SIGKILL what is left after `grace` seconds (or as soon as `hurry` is set).

        At once, so that the bound is the same whatever state the roles are in: a trainer waiting on groups that never
        come (every episode failing) finishes no step, and its checkpoint on SIGTERM would never start; checkpoints are
        written atomically, so one cut short is simply not there (the run resumes from the one before)."""
        # The trainer first (it checkpoints after its step), then the agents (they give their tickets back), then engines.
        order = sorted(self.roles, key=lambda r: {"trainer": 0, "rollout": 1, "engine": 2, "sandbox": 3}[r.name.split("-")[0]])
        for role in order:
            role.terminate()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.hurry and any(role.alive() for role in order):
            time.sleep(0.1)
        for role in order:
            role.kill()
        for held in self.ports:
            held.close()


def assign_gpus(exp: RLExperiment, gpus: int) -> dict[str, dict[str, str]]:
    """CUDA_VISIBLE_DEVICES per role: engines first (tp*pp each), then the trainer's processes.

    Roles on CPU get nothing; asking for more NVIDIA devices than the machine has is an error that
    names both numbers, not a silent pile-up on device 0.
    """
    spec = exp.spec
    wants: list[tuple[str, int]] = []
    if spec.rollout.accelerator.type == "nvidia":
        wants += [(f"engine-{i}", spec.rollout.accelerator.count) for i in range(spec.rollout.replicas)]
    if spec.trainer.accelerator.type == "nvidia":
        wants.append(("trainer", spec.trainer.accelerator.count * spec.trainer.nodes))
    need = sum(n for _, n in wants)
    if need == 0:
        return {}
    if need > gpus:
        raise SystemExit(f"kuberl run: the manifest asks for {need} NVIDIA GPUs (rollout and trainer together) but this machine has {gpus}; "
                         "use accelerator type cpu, or fewer replicas")
    out, next_gpu = {}, 0
    for role, n in wants:
        out[role] = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(next_gpu, next_gpu + n))}
        next_gpu += n
    return out


def local_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch build with CUDA: a CPU machine
        return 0


def prepare_manifest(exp: RLExperiment, workdir: Path, max_steps: int | None) -> Path:
    """Write the resolved manifest the roles read (the local counterpart of the runtime ConfigMap)."""
    doc = exp.model_copy(deep=True)
    if max_steps is not None:
        doc.spec.training.total_steps = max_steps
    data = doc.to_manifest()
    data.pop("status", None)
    data["spec"].pop("allocation", None)  # already expanded into the role fields
    path = workdir / "experiment.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main(args) -> int:
    if getattr(args, "ray", None):  # the same run with its roles placed on a Ray cluster
        from kuberl.runtime.ray_launcher import main as ray_main

        return ray_main(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prepared = _prepare(args)
    if isinstance(prepared, int):
        return prepared
    exp, manifest, workdir = prepared
    from kuberl.runtime.supervisor import BusProcess, Supervisor

    lifeline = Lifeline()  # every process started from here on dies with this one, however it ends
    lifeline.start_guard()
    try:
        server, bus_url = _start_bus(args, exp, workdir, lifeline)
        run = LocalRun(exp, manifest, workdir, bus_url, lifeline=lifeline)
        try:
            run.plan(gpus=local_gpu_count())
            run.add_sandbox()  # workflow.sandbox.placement pod: the sandbox server, a process of its own
        except SystemExit:
            if server is not None:
                server.stop()
            raise
        for role in run.roles:
            role.start()
        bus_proc = BusProcess(server) if server is not None else None
        supervisor = run.supervisor = Supervisor(run, bus_proc)  # restarts any dead process, the nats-server too
        print(f"kuberl run: started {', '.join(r.name for r in run.roles)}; logs in {workdir / 'logs'}")
        run.announce_episode_api()
        report, failure, interrupted = _supervise(run, supervisor, bus_proc, workdir)
        return _finish(run, workdir, report, failure, interrupted)
    finally:
        lifeline.close()  # the guard kills anything of the run still alive, then exits


def _prepare(args) -> tuple[RLExperiment, Path, Path] | int:
    """Load the experiment, make its workdir, write the run's manifest and build/fetch the model once:
    (experiment, manifest, workdir), or the exit code of a spec the run cannot start with."""
    try:
        exp = load_experiment(args.file)
    except Exception as exc:  # pydantic.ValidationError and YAML errors: print, don't trace
        print(f"kuberl run: {args.file} is not a valid RLExperiment:\n{exc}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or Path("runs") / exp.name).resolve()
    if workdir.exists() and not args.resume:
        shutil.rmtree(workdir)  # a fresh run; --resume keeps checkpoints and the bus state
    workdir.mkdir(parents=True, exist_ok=True)
    from kuberl.runtime.supervisor import route_logs

    route_logs(workdir / "logs" / "launcher.log")  # tracebacks go to the file, not the terminal
    manifest = prepare_manifest(exp, workdir, args.max_steps)
    exp = load_experiment(manifest)

    from kuberl.runtime.models import resolve_model

    print(f"kuberl run: {exp.name} in {workdir}")
    try:
        with spec_errors():
            resolve_model(exp.spec.model, str(workdir))  # build/fetch once, before the roles race for it
    except ConfigError as exc:
        print(f"kuberl run: configuration error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return exp, manifest, workdir


def _start_bus(args, exp: RLExperiment, workdir: Path, lifeline: Lifeline | None = None) -> tuple[Any, str]:
    """The bus URL (--bus-url, else spec.bus.external), or a nats-server of the run's own: (server or None, URL)."""
    server = None
    bus_url = args.bus_url
    if bus_url is None and exp.spec.bus.external is not None:
        bus_url = exp.spec.bus.external.url
    if bus_url is None:
        from kuberl.runtime.bus.server import start_nats_server

        # SCHED_BATCH like the rest of the rollout side (kuberl.runtime.resources.plan_local_cpus): it wakes at every message.
        server = start_nats_server(store_dir=str(workdir / "jetstream"), max_payload="8MB", log_path=str(workdir / "logs" / "nats-server.log"),
                                   batch_scheduling=True, lifeline=lifeline)
        bus_url = server.url
        print(f"kuberl run: nats-server (JetStream) at {bus_url}, pid {server.pid}")
    return server, bus_url


def _supervise(run: LocalRun, supervisor: Any, bus_proc: Any, workdir: Path) -> tuple[dict | None, str | None, bool]:
    """Show progress and supervise the roles until training ends, a role fails or the user stops the run;
    then stop every role and the bus. Returns (the last progress report, the failure, interrupted)."""
    failure: str | None = None
    interrupted = False
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def supervise() -> None:
        nonlocal failure
        while not stop.is_set():
            failure = supervisor.check()
            if failure or run.trainer.done:
                stop.set()
                break
            await asyncio.sleep(1.0)

    async def both() -> dict | None:
        sup = asyncio.create_task(supervise())
        report = await watch_progress(run, stop)
        stop.set()
        await sup
        return report

    def on_sigterm(signum, frame):  # `kill` of the launcher, or its terminal closed (SIGHUP), stops the run like Ctrl-C does
        raise KeyboardInterrupt

    def hurry(signum, frame):  # another one while stopping: kill what is left now
        run.hurry = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)
    # Ctrl-C too, even where the launcher inherited SIGINT ignored (a command started with `&` by a non-interactive
    # shell, e.g. a CI script, ignores it: Python then installs no handler, and SIGINT would not stop the run).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    report = None
    try:
        report = loop.run_until_complete(both())
        if report and report.get("done"):
            run.trainer.wait(timeout=120)  # let it write its final checkpoint
    except KeyboardInterrupt:
        interrupted = True
        stop_log.info("interrupted (SIGINT, SIGTERM or SIGHUP)")
        try:
            print(f"\nkuberl run: interrupted; stopping every role (SIGKILL after {STOP_GRACE_SECONDS:.0f}s, or now on a second "
                  "Ctrl-C)", file=sys.stderr)
        except OSError:  # the terminal is gone (SIGHUP)
            pass
    except subprocess.TimeoutExpired:
        pass
    except Exception as exc:  # unexpected: one line on the terminal, the traceback in the launcher's log
        log.exception("kuberl run failed")
        failure = failure or f"{type(exc).__name__}: {exc} (traceback in {workdir / 'logs' / 'launcher.log'})"
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # from here on, a signal hurries the stop
            signal.signal(sig, hurry)
        t0 = time.monotonic()
        run.stop_all()
        t1 = time.monotonic()
        _cancel_pending(loop)  # an interrupted loop still holds the progress watch and its bus connection
        if bus_proc is not None:
            bus_proc.stop()
        loop.close()
        stop_log.info("roles stopped in %.2fs, the bus %.2fs later", t1 - t0, time.monotonic() - t1)
    return report, failure, interrupted


def _cancel_pending(loop: asyncio.AbstractEventLoop, timeout: float = 2.0) -> None:
    """Cancel the loop's unfinished tasks and let them clean up (close the bus), at most `timeout` seconds: closed with
    them pending, the loop prints their tracebacks on the user's terminal."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    try:
        loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    except BaseException as exc:  # noqa: BLE001  a second Ctrl-C, or a task that fails while cancelled: stop anyway
        log.debug("launcher: tasks left after the run: %s", exc)


def _finish(run: LocalRun, workdir: Path, report: dict | None, failure: str | None, interrupted: bool) -> int:
    """Plot the reward curve, print the last report and the outcome; the exit code. An interrupted run is not plotted:
    drawing takes seconds on a busy machine, and a stop must end within its bound (`kuberl plot` draws it later)."""
    png = None if interrupted else plot_rewards(workdir / "metrics.jsonl", workdir / "reward.png")
    if report:
        print(f"kuberl run: step {report.get('step')}/{report.get('total_steps')}, policy version {report.get('policy_version')}, "
              f"last reward {fmt_number(report.get('reward_mean'))}")
        if ev := eval_text(report.get("eval")):
            print(f"kuberl run: {ev}")
    if png:
        print(f"kuberl run: reward curve in {png}; metrics in {workdir / 'metrics.jsonl'}")
    if failure:
        print(f"kuberl run: failed: {failure}", file=sys.stderr)
        return CONFIG_ERROR_EXIT if run.config_error else 1
    if interrupted:
        if (workdir / "metrics.jsonl").exists():
            print(f"kuberl run: metrics in {workdir / 'metrics.jsonl'}; draw them with `kuberl plot {workdir}`")
        return 130
    if report and report.get("failed"):
        print(f"kuberl run: trainer failed: {report['failed']}", file=sys.stderr)
        return 1
    return 0
