"""CPU resources per role: which cores each local role gets, and how many threads each process runs.

Pure functions (core split, cgroup quota, thread environment; and the host memory left, for the trainer's background
checkpoints) used by `kuberl run` to give the engines
and the trainer their own cores, and by every role entry point (`kuberl engine|rollout|trainer`, via
`apply_process_resources`) so that in a pod thread pools follow the container's CPU limit, not the node.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

CPUS_ENV = "KUBERL_CPUS"  # cores this role's processes run on, given by `kuberl run`, e.g. "0-1,4"
COMPUTE_CPUS_ENV = "KUBERL_COMPUTE_CPUS"  # an engine's: the cores its model workers compute on (default: $KUBERL_CPUS)
THREADS_ENV = "KUBERL_THREADS"  # compute threads per process of this role
BATCH_ENV = "KUBERL_SCHED_BATCH"  # "1": this role's processes run under Linux SCHED_BATCH (`kuberl run`'s rollout side)
# Every thread pool a role's libraries size from the environment (torch/OpenMP, MKL, OpenBLAS, numexpr).
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
ROLE_COMMANDS = ("engine", "rollout", "trainer")


class ResourceError(ValueError):
    """A CPU list or thread count in the environment that cannot be used (the message names the variable)."""


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5] (the Linux cpulist format, as in cpuset.cpus and taskset -c)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ResourceError(f"{text!r} is not a CPU list (expected e.g. 0-3,6)") from None
        if a < 0 or b < a:
            raise ResourceError(f"{text!r} is not a CPU list: range {part!r} is empty or negative")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ResourceError(f"{text!r} is not a CPU list: it names no core")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpu_quantity(value: Any) -> float | None:
    """A Kubernetes CPU quantity (2, '1.5', '500m') in cores; None when absent."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ResourceError(f"{value!r} is not a CPU quantity (e.g. 2, 1.5, 500m)") from None


def cgroup_cpu_limit(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The container's CPU limit in cores from the cgroup quota (v2 cpu.max, else v1 cfs quota); None = unlimited."""
    root = Path(root)
    try:
        fields = (root / "cpu.max").read_text().split()  # "max 100000" or "150000 100000"
    except OSError:
        fields = []
    if fields:
        if fields[0] == "max":
            return None
        try:
            quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
        except ValueError:
            quota = period = 0
        if quota > 0 and period > 0:
            return quota / period
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota_us = int((root / sub / "cpu.cfs_quota_us").read_text())
            period_us = int((root / sub / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def host_memory_free(cgroup: str | Path = "/sys/fs/cgroup", meminfo: str | Path = "/proc/meminfo") -> int | None:
    """Bytes this process may still allocate on the host: the container's memory limit (cgroup v2 memory.max minus
    memory.current, else v1) where there is one, and the machine's MemAvailable, whichever is smaller; None = unknown."""
    found: list[int] = []
    root = Path(cgroup)
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and limit_text.isdigit() and int(limit_text) < 1 << 60:  # v1 writes ~2^63 for "no limit"
            found.append(max(0, int(limit_text) - usage))
        break
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    return min(found) if found else None


def thread_count(cores: int, limit: float | None) -> int:
    """Threads for `cores` usable cores under a CPU limit: the whole cores the quota pays for, at least 1.

    A 1.5-core limit gets 1 thread: a second one would be throttled for half of every period and
    make the first wait at each parallel barrier.
    """
    n = max(1, cores)
    if limit is not None:
        n = min(n, max(1, math.floor(limit + 1e-9)))
    return n


def engine_omp_threads(threads: int, ranks: int = 1) -> int:
    """OpenMP threads of each engine worker: like vLLM's own binding, one thread per rank is left to the
    server and scheduler processes when there are more threads than ranks (4 -> 3; 2 -> 1; 1 -> 1)."""
    ranks = max(1, ranks)
    return max(1, (threads - ranks) // ranks) if threads > ranks else 1


@dataclass(frozen=True)
class RoleCPUs:
    """The cores a local role runs on and the compute threads of each of its processes.

    `compute` (engines): the cores its model workers are bound to, when they are not all of `cpus`.
    """

    cpus: tuple[int, ...]
    threads: int
    compute: tuple[int, ...] | None = None
    batch: bool = False  # run under SCHED_BATCH (batch_scheduling): it shares cores with the trainer


def split_cores(cpus: list[int], weights: dict[str, float]) -> dict[str, RoleCPUs]:
    """Disjoint core blocks, in order, sized by weight (each group at least one core).

    With fewer cores than groups no block can be disjoint: every group shares all cores and gets
    cores // groups threads (at least 1), so that together they do not ask for more than there is.
    """
    cpus = sorted(set(cpus))
    names = list(weights)
    if not names:
        return {}
    if any(w <= 0 for w in weights.values()):
        raise ResourceError(f"core weights must be positive: {weights}")
    if len(cpus) < len(names):
        threads = max(1, len(cpus) // len(names))
        return {n: RoleCPUs(tuple(cpus), threads) for n in names}
    spare = len(cpus) - len(names)  # one core each first, then the rest by weight (largest remainder)
    total = sum(weights.values())
    exact = {n: spare * weights[n] / total for n in names}
    extra = {n: math.floor(exact[n]) for n in names}
    for n in sorted(names, key=lambda n: exact[n] - extra[n], reverse=True)[: spare - sum(extra.values())]:
        extra[n] += 1
    out, i = {}, 0
    for n in names:
        k = 1 + extra[n]
        out[n] = RoleCPUs(tuple(cpus[i: i + k]), k)
        i += k
    return out


def _role_cpu_weight(block: Any, multiplier: int) -> float:
    res = getattr(block, "resources", None)
    cores = None
    if res is not None:
        cores = cpu_quantity(res.requests.get("cpu")) or cpu_quantity(res.limits.get("cpu"))
    return (cores or 1.0) * multiplier


def plan_local_cpus(exp: Any, cpus: list[int]) -> dict[str, RoleCPUs]:
    """Cores and threads of each `kuberl run` role: engine-i with its agent rollout-i, and the trainer.

    Compute is split by the manifest's CPU requests (else limits; else one share each): on 2 cores,
    1 engine and 1 trainer compute on one core each. An engine's model workers are bound to its block;
    its server and scheduler processes and its agent (one thread: it waits on the engine and the bus)
    run on every core, where the trainer's idle time serves them (measured: bench/bench_trl.py went
    from 151 to 193 samples/s when they stopped queueing behind the engine's worker on its one core).
    So the engines and agents share the trainer's cores, and run under SCHED_BATCH (`batch`): the trainer's
    update is the step's critical path, and the rollout side, which works ahead, should not preempt it at
    every wake-up (see batch_scheduling).
    """
    spec = exp.spec
    weights = {f"engine-{i}": _role_cpu_weight(spec.rollout, 1) for i in range(spec.rollout.replicas)}
    weights["trainer"] = _role_cpu_weight(spec.trainer, spec.trainer.nodes)
    plan = split_cores(cpus, weights)
    every = tuple(sorted(set(cpus)))
    for i in range(spec.rollout.replicas):
        block = plan[f"engine-{i}"]
        if block.cpus != every:  # its own block: workers there, the rest anywhere
            block = RoleCPUs(every, block.threads, compute=block.cpus)
        plan[f"engine-{i}"] = replace(block, batch=True)
        plan[f"rollout-{i}"] = RoleCPUs(every, 1, batch=True)
    nproc = max(spec.trainer.accelerator.count, 1) * spec.trainer.nodes
    t = plan["trainer"]
    plan["trainer"] = RoleCPUs(t.cpus, max(1, t.threads // nproc))  # torchrun ranks share the trainer's block
    return plan


def role_env(role: RoleCPUs) -> dict[str, str]:
    """What `kuberl run` adds to a role's environment: its cores (and an engine's compute cores) and its threads per process."""
    env = {CPUS_ENV: format_cpu_list(list(role.cpus)), THREADS_ENV: str(role.threads)}
    if role.batch:
        env[BATCH_ENV] = "1"
    if role.compute is not None:
        env[COMPUTE_CPUS_ENV] = format_cpu_list(list(role.compute))
    return env


def process_settings(command: str, environ: dict[str, str], affinity: list[int], limit: float | None,
                     tensor_parallel: int = 1) -> tuple[list[int], dict[str, str]]:
    """(cores to pin this process to, environment to set) for a role process, before any library starts threads.

    Cores: $KUBERL_CPUS (from `kuberl run`), else the current affinity (a pod's cpuset). Threads:
    $KUBERL_THREADS, else the whole cores of the cgroup limit (else the cores), shared by torchrun's
    $LOCAL_WORLD_SIZE trainer ranks. A variable the user set
    already (OMP_NUM_THREADS...) is kept. The engine's OpenMP threads are bound to its cores
    (VLLM_CPU_OMP_THREADS_BIND, one block per tensor-parallel rank: within $KUBERL_COMPUTE_CPUS where
    `kuberl run` lets the server run on more cores than its workers, else $KUBERL_CPUS less one core for the server)
    when `kuberl run` gave it cores,
    and left unbound with OMP_NUM_THREADS per rank in a pod, where the node's cores are shared.
    """
    given = environ.get(CPUS_ENV)
    cpus = parse_cpu_list(given) if given else sorted(affinity)
    raw = environ.get(THREADS_ENV)
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            raise ResourceError(f"${THREADS_ENV}={raw!r} is not a number of threads") from None
        if threads < 1:
            raise ResourceError(f"${THREADS_ENV}={raw!r}: a process needs at least one thread")
    else:
        threads = thread_count(len(cpus), limit)
        if command == "trainer":  # torchrun's ranks in one container share its cores
            try:
                threads = max(1, threads // max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1)))
            except ValueError:
                raise ResourceError(f"$LOCAL_WORLD_SIZE={environ['LOCAL_WORLD_SIZE']!r} is not a number of processes") from None
    tp = max(1, tensor_parallel)
    compute_given = environ.get(COMPUTE_CPUS_ENV) if command == "engine" else None
    if compute_given:  # the server and scheduler have other cores: every compute core runs a worker thread
        per_proc = max(1, min(threads, len(parse_cpu_list(compute_given))) // tp)
    else:
        per_proc = engine_omp_threads(threads, tp) if command == "engine" else threads
    env = {k: str(per_proc) for k in THREAD_VARS}
    env["TOKENIZERS_PARALLELISM"] = "false" if threads == 1 else "true"
    if command == "engine":
        if given or compute_given:  # one block of per_proc cores per rank; what is left runs the API server and the scheduler
            used = (parse_cpu_list(compute_given) if compute_given else cpus)[: per_proc * tp]
            blocks = [used[k * per_proc:(k + 1) * per_proc] or used[-1:] for k in range(tp)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(format_cpu_list(b) for b in blocks)
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    out = {k: v for k, v in env.items() if not environ.get(k)}
    return cpus, out


def engine_world_size(config: str | None) -> int:
    """Processes of one engine (tensor x pipeline parallel) from the manifest; 1 when it cannot be read
    (the engine's own start-up then reports the manifest's problem)."""
    if not config:
        return 1
    try:
        from kuberl.api import load_experiment

        rollout = load_experiment(config).spec.rollout
        return max(1, rollout.tensor_parallel_size * rollout.pipeline_parallel_size)
    except Exception:
        return 1


def available_cpus() -> list[int]:
    """The cores this process may run on (its affinity: a container's cpuset), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def apply_process_resources(command: str, config: str | None = None) -> dict[str, str]:
    """Pin this role process to its cores and size its thread pools (call before importing torch or vLLM).

    Returns the environment it set. The engine's server inherits both through exec.
    """
    if command not in ROLE_COMMANDS:
        return {}
    tensor_parallel = engine_world_size(config) if command == "engine" else 1
    affinity = available_cpus()
    cpus, env = process_settings(command, dict(os.environ), affinity, cgroup_cpu_limit(), tensor_parallel)
    if cpus != affinity:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as exc:
            raise ResourceError(f"${CPUS_ENV}={format_cpu_list(cpus)}: cannot pin this process to those cores ({exc})") from None
    os.environ.update(env)
    if wants_batch_scheduling(os.environ):
        batch_scheduling()
    return env


def wants_batch_scheduling(environ: Mapping[str, str]) -> bool:
    """$KUBERL_SCHED_BATCH: "1" yes, "0" or unset no; anything else is an error that names it."""
    raw = environ.get(BATCH_ENV, "")
    if raw not in ("", "0", "1"):
        raise ResourceError(f"${BATCH_ENV}={raw!r}: 1 (run under SCHED_BATCH) or 0")
    return raw == "1"


def batch_scheduling() -> bool:
    """Put this process under Linux SCHED_BATCH (threads and processes it starts from here on inherit it).

    The kernel then treats it as throughput work: same share of the CPU as before (nice 0), but it does not
    preempt the task running on a core when it wakes up. `kuberl run` uses it for the rollout side, whose
    engine server, engine core, agent and nats-server wake hundreds of times a second on the cores the
    trainer computes on: measured on 2 cores (bench manifest of bench/bench_trl.py, alternating 20 s windows
    of one run, 2026-11-28), the trainer was preempted 2.5x less often (~240 instead of ~620 times a second)
    and the run made 2-3% more samples/s. No privilege is needed. False where the platform has no SCHED_BATCH.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True
