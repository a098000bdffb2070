"""The operator at scale: N RLExperiments on the real local control plane, steady-state cost per experiment.

Run: `python bench/bench_operator_scale.py --n 100` (and `--n 300`). Starts the local control plane
(kuberl.testing.control_plane: etcd, kube-apiserver, controller manager, scheduler, and KWOK nodes whose pods run
without containers; `bash scripts/install-control-plane.sh` builds it once), `helm install`s charts/kuberl with its
defaults (replicaCount 0: no image) but for `tenantNamespaces` (the bench's namespaces) and runs the operator here as
the chart's Deployment runs it: the chart's ServiceAccount and RBAC, its args (leader election on) and environment,
the operator's own defaults for what the chart leaves unset (monitor every 5 s).

The default deployment (`--bus embedded`, the default): N experiments spread round-robin over `--namespaces` (4:
team-0..team-3, each a tenant namespace of the chart, so the operator writes there by the chart's RoleBindings), each
with its own embedded bus (no spec.bus.external: the operator makes a NATS StatefulSet, its Services, NetworkPolicy,
credentials Secret and JetStream claim per experiment), and `--gpu-share` of them (0.5) GPU experiments
(`accelerator: {type: nvidia, count: 1}` for rollout and trainer) scheduled on fake GPU nodes (8 `nvidia.com/gpu`
allocatable each, GKE's taint; the API server's ExtendedResourceToleration adds the toleration). KWOK's pods run no
NATS, so every bus read of the operator fails: the operator is started through run_operator_counting_lookups, which
records each lookup of a `*.svc` name (the buses' URLs, `nats://s0001-bus.team-1.svc:4222`) and, by default
(`--unreachable-bus refused`), resolves it to a loopback address where nothing listens, so the connect is refused at
once, as a Service without a ready endpoint refuses it in a cluster (`dns`: this machine's resolver, which knows no
cluster names). It changes nothing else. These are failing reads, not progress reads: no progress reaches the
status, so the steady state has no progress-driven status writes; the bench reports the failed connects, the
operator's monitor ticks (its metrics) and its log lines. `--bus external` is the shared-bus mode: one real
nats-server for every experiment (spec.bus.external), bus progress with a growing step written every
`--progress-every` s for each running one, so the operator reads real progress and writes it to the status every 30 s
(`--bus external --namespaces 1 --gpu-share 0` is the setting of the earlier runs: CPU experiments in `default`).

It creates the experiments with enough PersistentVolumes for their claims (checkpoints, and the buses' JetStream
volumes) and enough fake nodes for their pods (CPU nodes for the CPU experiments' pods and every bus pod, GPU nodes
for the GPU pods); the StatefulSet and Job controllers, the scheduler and KWOK bring the pods up. `--finished` of them
finish: their trainer pods exit 0 (ControlPlane.exit), so the Job completes, and the operator stops their bus. It
waits for the steady state, then measures for `--measure` seconds while it touches the API itself no more.

The operator's requests are counted from the API server's audit log (every request of the chart's ServiceAccount).
Printed: the operator's API requests/s (by verb and resource, and by namespace; watches are long-lived and listed
apart), status writes/s, the requests that named a finished experiment, the operator's CPU and RSS (per experiment
over the RSS before any experiment existed), its bus connections (external) or failed bus lookups (embedded), its
log lines, and the CPU and memory of the API server and etcd. Issue 11's target per running experiment: <= 0.2 API
requests/s and <= 1 status write per 30 s; none for finished ones. Not a test: the figures depend on the machine;
tests/unit/test_operator_scale.py and tests/integration/test_operator_api_cost.py check the rules. On a 2-core VM
(2026-12-02, not quiet: a test suite ran beside it) a default run took 6.1 min at --n 100 and 15.7 min at --n 300, a
shared-bus run 4.5, 9.2 and 11.4 min at --n 100, 300 and 500, most of it the start-up reconcile of every experiment
(docs/benchmarks.md#the-operator-at-scale has the figures). It needs about 2.5 GiB of memory in all at --n 500 with
the shared bus (the API server's peak 1.3 GiB), about 2 GiB at --n 300 by default. `--keep` keeps the control plane's
logs, its audit log, the operator's log and the lookups file.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
RELEASE, OPERATOR_NAMESPACE = "kuberl", "kuberl-system"
RLX_ALL = "/apis/kuberl.io/v1alpha1/rlexperiments"
BUS_RUN = "kuberl.io/bus-run"
PODS_PER_NODE, GPUS_PER_NODE = 110, 8
CPU_NODE = {"cpu": "256", "memory": "2048Gi", "ephemeral-storage": "10Ti", "pods": str(PODS_PER_NODE)}
# Shaped as control_plane.NODE_POOLS' h100 pool: GKE's accelerator label, the GPU taint, 8 GPUs.
GPU_NODE = {"cpu": "208", "memory": "1872Gi", "ephemeral-storage": "6Ti", "pods": str(PODS_PER_NODE), "nvidia.com/gpu": str(GPUS_PER_NODE)}
GPU_LABELS = {"kuberl.test/pool": "gpu", "cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "kuberl.io/pool": "h100",
              "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.present": "true"}
LOOKUPS_FLAG = "--operator-counting-lookups"
REFUSING_ADDRESS = "127.77.0.1"  # a loopback address no one listens on (checked before the run)


def rlx_path(namespace: str) -> str:
    return f"/apis/kuberl.io/v1alpha1/namespaces/{namespace}/rlexperiments"


def bench_namespaces(count: int) -> list[str]:
    """`default` alone (the chart's default tenant namespace) for one, else team-0..team-{count-1}."""
    return ["default"] if count == 1 else [f"team-{i}" for i in range(count)]


def manifest(name: str, namespace: str, bus_url: str | None, gpu: bool = False) -> dict[str, Any]:
    """A small experiment; on a GPU an engine and a trainer of one NVIDIA GPU each; with `bus_url` on that external
    bus, else on its own embedded bus (the default)."""
    rollout, trainer = ({"type": "nvidia", "count": 1}, {"type": "nvidia", "count": 1}) if gpu else \
        ({"type": "cpu", "count": 0}, {"type": "cpu", "count": 1})
    spec: dict[str, Any] = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                            "rollout": {"replicas": 1, "accelerator": rollout}, "trainer": {"accelerator": trainer},
                            "training": {"totalSteps": 100000}}
    if bus_url:
        spec["bus"] = {"external": {"url": bus_url}}
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def plan(n: int, namespaces: list[str], gpu_share: float) -> list[tuple[str, str, bool]]:
    """(name, namespace, gpu) of each experiment: round-robin over the namespaces, and within each namespace every
    1/gpu_share-th one a GPU experiment (so each namespace has its share, and so do the first, finished, ones)."""
    out = []
    for i in range(n):
        j = i // len(namespaces)
        out.append((f"s{i:04d}", namespaces[i % len(namespaces)], math.floor((j + 1) * gpu_share) > math.floor(j * gpu_share)))
    return out


def run_operator_counting_lookups(path: str, unreachable: str, argv: list[str]) -> int:
    """`kuberl operator ARGV` in this process, with each lookup of a cluster Service name (`*.svc`: the embedded
    buses' URLs) appended to `path` as "<unix time> <host>". With `unreachable` "refused", such a name resolves to
    REFUSING_ADDRESS, where nothing listens, so the connect is refused at once, as a Service without a ready endpoint
    refuses it in a cluster (the kube-proxy REJECT rule); with "dns" it goes to this machine's resolver, which knows
    no cluster names (and may be slow to say so). Nothing else changes."""
    import runpy
    import socket

    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode(errors="replace") if isinstance(host, bytes) else host
        if isinstance(name, str) and name.endswith(".svc"):
            out.write(f"{time.time():.3f} {name}\n")
            if unreachable == "refused":
                return real(REFUSING_ADDRESS, port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo  # asyncio's loop.getaddrinfo looks it up on each call
    sys.argv = ["kuberl", *argv]
    runpy.run_module("kuberl.cli", run_name="__main__", alter_sys=True)
    return 0


def refuses(address: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(2)
        try:
            sock.connect((address, port))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(CPU seconds used, RSS bytes, peak RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = {line.split(":")[0]: line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line}
    return cpu, int(status["VmRSS"][0]) * 1024, int(status["VmHWM"][0]) * 1024


def tcp_connections(pid: int, port: int) -> int:
    """Established TCP connections of a process to a loopback port (its socket inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def parse_time(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Api:
    """The bench's own requests, as the cluster admin (the audit count leaves them out)."""

    def __init__(self, cp: Any) -> None:
        self.cp, self.http = cp, cp.session()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        r = self.http.request(method, self.cp.server + path, data=None if body is None else json.dumps(body),
                              headers={"Content-Type": "application/json"})
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r.json() if r.content else None

    def items(self, path: str) -> list[dict[str, Any]]:
        return self.call("GET", path)["items"]


def install_chart(cp: Any, tmp: Path, namespaces: list[str]) -> dict[str, Any]:
    """`helm install` the chart with its defaults but no replica (as the root conftest.py does) and `namespaces` as its
    tenantNamespaces (which must exist first; the chart binds the operator's writes there); its Deployment."""
    env = {**os.environ, "KUBECONFIG": cp.kubeconfig, "PATH": f"{cp.bin}{os.pathsep}{os.environ.get('PATH', '')}",
           **{f"HELM_{k}_HOME": str(tmp / f"helm-{k.lower()}") for k in ("CACHE", "CONFIG", "DATA")}}
    made = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in namespaces if ns != "default"]
    if made:
        cp.apply(*made)
    out = subprocess.run(["helm", "install", RELEASE, str(ROOT / "charts" / "kuberl"), "--namespace", OPERATOR_NAMESPACE,
                          "--create-namespace", "--set", "replicaCount=0", "--set-json", f"tenantNamespaces={json.dumps(namespaces)}",
                          "--wait", "--timeout", "3m"],
                         env=env, capture_output=True, text=True, timeout=240, check=False)
    if out.returncode != 0:
        raise SystemExit(f"helm install failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(cp.kubectl("get", "deployment", RELEASE, "-n", OPERATOR_NAMESPACE, "-o", "json").stdout)


def operator_settings(deployment: dict[str, Any]) -> tuple[list[str], dict[str, str], dict[str, float]]:
    """The Deployment's container args and plain environment, and the timings the operator runs with there: the
    chart's env where it sets them, else the operator's own defaults (kuberl/operator/context.py)."""
    from kuberl.operator.context import OperatorConfig

    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    knobs = {"KUBERL_OPERATOR_INTERVAL": "interval", "KUBERL_CHECKPOINT_TIMEOUT": "checkpoint_timeout", "KUBERL_OPERATOR_RETRY": "retry_delay"}
    saved = {k: os.environ.pop(k) for k in knobs if k in os.environ}
    try:
        defaults = OperatorConfig()
    finally:
        os.environ.update(saved)
    timings = {k: float(env.pop(k)) if k in env else getattr(defaults, attr) for k, attr in knobs.items()}
    return container.get("args", []), env, timings


def needs(exp: dict[str, Any]) -> tuple[collections.Counter[str], int, int, int]:
    """What one experiment asks of the cluster, from `kuberl render`'s objects: its claims by access mode
    (PersistentVolumeClaims and StatefulSets' volumeClaimTemplates), its pods without and with GPUs, and its GPUs."""
    from kuberl.operator.render import render

    claims: collections.Counter[str] = collections.Counter()
    cpu_pods = gpu_pods = gpus = 0
    for o in render(exp):
        spec = o.get("spec") or {}
        if o["kind"] == "PersistentVolumeClaim":
            claims.update(spec["accessModes"])
        if o["kind"] not in ("StatefulSet", "Job"):
            continue
        count = int(spec.get("replicas", 1) if o["kind"] == "StatefulSet" else spec.get("parallelism", 1))
        for template in spec.get("volumeClaimTemplates", []):
            claims.update({m: count for m in template["spec"]["accessModes"]})
        per_pod = sum(int(((c.get("resources") or {}).get("requests") or {}).get("nvidia.com/gpu", 0))
                      for c in spec["template"]["spec"]["containers"])
        gpus += count * per_pod
        if per_pod:
            gpu_pods += count
        else:
            cpu_pods += count
    return claims, cpu_pods, gpu_pods, gpus


def add_room(cp: Any, experiments: list[dict[str, Any]]) -> dict[str, int]:
    """Fake nodes for the experiments' pods beyond the control plane's own pools: CPU nodes for the pods without GPUs
    (buses included), GPU nodes (8 GPUs, GPU taint) for those with; and a PersistentVolume of the default class for
    every claim (no provisioner runs), of the access mode asked. Returns what was added."""
    from kuberl.testing.control_plane import GPU_TAINT, STORAGE_CLASS

    claims: collections.Counter[str] = collections.Counter()
    cpu_pods = gpu_pods = gpus = 0
    shapes: dict[str, tuple[collections.Counter[str], int, int, int]] = {}
    for exp in experiments:  # the same shape renders the same needs: render each kind once
        key = json.dumps(exp["spec"], sort_keys=True)
        shape = shapes.setdefault(key, needs(exp))
        claims.update(shape[0])
        cpu_pods, gpu_pods, gpus = cpu_pods + shape[1], gpu_pods + shape[2], gpus + shape[3]
    pools = {"bench": (math.ceil(cpu_pods / PODS_PER_NODE), {"kuberl.test/pool": "cpu"}, [], CPU_NODE)}
    if gpu_pods:
        pools["bench-gpu"] = (max(math.ceil(gpu_pods / PODS_PER_NODE), math.ceil(gpus / GPUS_PER_NODE)), GPU_LABELS, [GPU_TAINT], GPU_NODE)
    cp.add_nodes({k: v for k, v in pools.items() if v[0]})
    pvs = [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"bench-{mode.lower()}-{i}"},
            "spec": {"capacity": {"storage": "16Ti"}, "accessModes": [mode], "storageClassName": STORAGE_CLASS,
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/kuberl-fake-volumes/bench-{mode.lower()}-{i}"}}}
           for mode, count in sorted(claims.items()) for i in range(count)]
    for i in range(0, len(pvs), 200):
        cp.apply(*pvs[i:i + 200])
    return {"cpu nodes": pools["bench"][0], "gpu nodes": pools.get("bench-gpu", (0,))[0], "cpu pods": cpu_pods, "gpu pods": gpu_pods,
            "gpus": gpus, **{f"{m} volumes": c for m, c in sorted(claims.items())}}


async def write_progress(bus_url: str, runs: dict[str, str], stop: asyncio.Event, every: float) -> None:
    """Bus progress with a growing step for each running experiment, every `every` seconds (as a trainer)."""
    import nats

    from kuberl.operator.progress import kv_bucket

    nc = await nats.connect(bus_url)
    js = nc.jetstream()
    stores = {name: await js.create_key_value(bucket=kv_bucket(name, run)) for name, run in runs.items()}
    step = 0
    while not stop.is_set():
        step += 1
        for kv in stores.values():
            await kv.put("progress", json.dumps({"step": step, "total_steps": 100000, "epoch": 0, "policy_version": step,
                                                 "done": False, "failed": None, "time": time.time()}).encode())
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
        except TimeoutError:
            pass
    await nc.close()


def wait(what: str, fn: Callable[[], Any], timeout: float, op: Any, every: float = 5.0) -> None:
    """Poll `fn` every `every` seconds (each poll lists every experiment) until it is true; the operator must live."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        if not op.alive:
            raise SystemExit(f"the operator died while waiting for {what}:\n{op.log_tail()}")
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}\n--- operator log ---\n{op.log_tail()}")


def monitor_ticks(op: Any) -> float:
    """The operator's monitor ticks that did work so far (kuberl_operator_reconciles_total{handler="monitor"}: a tick of
    a finished experiment at rest is not counted)."""
    found = re.search(r'^kuberl_operator_reconciles_total\{handler="monitor"\} (\S+)$', op.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def log_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def lookups(path: Path, t0: float, t1: float) -> list[tuple[float, str]]:
    """(time, host) of each `*.svc` lookup of the operator between t0 and t1 (run_operator_counting_lookups' file)."""
    out = []
    for line in log_lines(path):
        stamp, _, host = line.partition(" ")
        try:
            if t0 <= float(stamp) < t1:
                out.append((float(stamp), host))
        except ValueError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [LOOKUPS_FLAG]:
        return run_operator_counting_lookups(argv[1], argv[2], argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Target per running experiment: <= 0.2 API requests/s, <= 1 status write per 30 s; none for finished ones.")
    ap.add_argument("--n", type=int, default=100, help="experiments (default 100)")
    ap.add_argument("--bus", choices=("embedded", "external"), default="embedded",
                    help="embedded: a bus per experiment, the default deployment (default); external: one shared nats-server")
    ap.add_argument("--namespaces", type=int, default=4, help="tenant namespaces the experiments are spread over (default 4; 1: `default`)")
    ap.add_argument("--unreachable-bus", choices=("refused", "dns"), default="refused",
                    help="with embedded buses, what the operator's bus connects meet: refused (the Service name resolves to a loopback "
                         "address where nothing listens, as a Service without ready endpoints; default) or dns (this machine's resolver, "
                         "which knows no cluster name)")
    ap.add_argument("--gpu-share", type=float, default=0.5, help="fraction of GPU experiments (default 0.5)")
    ap.add_argument("--finished", type=float, default=0.2, help="fraction of them whose trainer has completed (default 0.2)")
    ap.add_argument("--measure", type=float, default=90.0, help="seconds of steady state measured (default 90: three status periods)")
    ap.add_argument("--settle", type=float, default=40.0, help="seconds waited once every phase is right, before measuring (default 40)")
    ap.add_argument("--progress-every", type=float, default=5.0,
                    help="seconds between bus progress writes per experiment, with --bus external (default 5)")
    ap.add_argument("--setup-timeout", type=float, default=900.0, help="seconds allowed for each wait while setting up (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (control plane logs, audit log, operator log)")
    args = ap.parse_args(argv)
    if args.n < 1 or not 0 <= args.finished < 1 or args.measure <= 0 or args.namespaces < 1 or not 0 <= args.gpu_share <= 1:
        ap.error("--n and --namespaces must be >= 1, --finished in [0, 1), --gpu-share in [0, 1], --measure > 0")

    from kuberl.runtime.bus.server import start_nats_server
    from kuberl.testing.control_plane import ControlPlane
    from kuberl.testing.operator_process import OperatorProcess

    tmp = Path(tempfile.mkdtemp(prefix="kuberl-bench-operator-"))
    t_start = time.monotonic()
    namespaces = bench_namespaces(args.namespaces)
    experiments = plan(args.n, namespaces, args.gpu_share)
    # Every request of a ServiceAccount of the operator's namespace, on any resource (the default policy records only
    # KubeRL's and Kueue's resources); filtered below to the chart's ServiceAccount.
    rules = [{"level": "Metadata", "userGroups": [f"system:serviceaccounts:{OPERATOR_NAMESPACE}"]}]
    external = args.bus == "external"
    nats_server = start_nats_server(store_dir=str(tmp / "nats")) if external else None
    bus_url = nats_server.url if nats_server else None
    lookups_file = tmp / "operator-lookups.txt"
    if not external:  # the operator through run_operator_counting_lookups
        if args.unreachable_bus == "refused" and not refuses(REFUSING_ADDRESS, 4222):
            raise SystemExit(f"{REFUSING_ADDRESS}:4222 does not refuse connections here: use --unreachable-bus dns")
        os.environ["KUBERL_TEST_OPERATOR_CMD"] = (f"{sys.executable} {Path(__file__).resolve()} {LOOKUPS_FLAG} {lookups_file} "
                                                  f"{args.unreachable_bus}")
    try:
        with ControlPlane(tmp / "control-plane", audit_rules=rules) as cp:
            print(f"control plane up in {cp.start_seconds:.0f}s", flush=True)
            api = Api(cp)
            deployment = install_chart(cp, tmp, namespaces)
            manifests = [manifest(name, ns, bus_url, gpu) for name, ns, gpu in experiments]
            room = add_room(cp, manifests)
            op_args, env, timings = operator_settings(deployment)
            sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"
            kubeconfig = cp.kubeconfig_for(sa, OPERATOR_NAMESPACE, tmp / "operator.kubeconfig")
            pod_name = f"{RELEASE}-bench-0"
            env |= {"POD_NAME": pod_name, "POD_NAMESPACE": OPERATOR_NAMESPACE}  # the Deployment's fieldRefs
            print(f"chart installed (tenantNamespaces {namespaces}), room {room}, operator args {op_args}, {timings} "
                  f"after {time.monotonic() - t_start:.0f}s", flush=True)
            with OperatorProcess(kubeconfig, tmp / "operator.log", interval=timings["KUBERL_OPERATOR_INTERVAL"],
                                 checkpoint_timeout=timings["KUBERL_CHECKPOINT_TIMEOUT"], retry=timings["KUBERL_OPERATOR_RETRY"],
                                 standalone="--standalone" in op_args, leader_election="--leader-election" in op_args,
                                 extra_env=env) as op:
                pid = op.proc.pid

                def leads() -> bool:
                    got = cp.kubectl("get", "lease", "kuberl-operator", "-n", OPERATOR_NAMESPACE, "-o",
                                     "jsonpath={.spec.holderIdentity}", check=False)
                    return got.returncode == 0 and got.stdout.strip() == pod_name

                if "--leader-election" in op_args:
                    wait("the operator to hold the Lease", leads, 120, op, every=1)
                time.sleep(10)  # kopf's watches up
                _, rss0, _ = proc_stats(pid)
                names = [name for name, _, _ in experiments]
                namespace_of = {name: ns for name, ns, _ in experiments}
                gpus = {name for name, _, gpu in experiments if gpu}
                finished = set(names[: int(args.n * args.finished)])
                running = [n for n in names if n not in finished]
                cpu_create, _, _ = proc_stats(pid)
                t_create, wall_create = time.monotonic(), time.time()
                for m in manifests:
                    api.call("POST", rlx_path(m["metadata"]["namespace"]), m)
                print(f"created {args.n} experiments ({len(gpus)} on GPUs) in {len(namespaces)} namespaces in "
                      f"{time.monotonic() - t_create:.0f}s ({time.monotonic() - t_start:.0f}s from the start)", flush=True)

                def reconciled() -> bool:
                    xs = api.items(RLX_ALL)
                    done = sum(1 for x in xs if (x.get("status") or {}).get("observedGeneration") == x["metadata"]["generation"])
                    return done == args.n and all(x["metadata"].get("annotations", {}).get(BUS_RUN) for x in xs)

                wait("every experiment reconciled", reconciled, args.setup_timeout, op)
                print(f"reconciled {time.monotonic() - t_create:.0f}s after the first create", flush=True)
                stop = asyncio.Event()
                loop = asyncio.new_event_loop()
                writer = None
                if bus_url:
                    runs = {x["metadata"]["name"]: x["metadata"]["annotations"][BUS_RUN] for x in api.items(RLX_ALL)}
                    writer = threading.Thread(target=loop.run_until_complete, daemon=True,
                                              args=(write_progress(bus_url, {n: runs[n] for n in running}, stop, args.progress_every),))
                    writer.start()
                exited: set[str] = set()

                def finish_trainers() -> None:
                    """The finished experiments' trainer pods exit 0 once they run (KWOK plays it)."""
                    pods = api.items("/api/v1/pods?labelSelector=kuberl.io/role%3Dtrainer")
                    due: dict[str, list[str]] = collections.defaultdict(list)
                    for p in pods:
                        exp_name = p["metadata"].get("labels", {}).get("kuberl.io/experiment")
                        if (exp_name in finished and (p.get("status") or {}).get("phase") == "Running"
                                and p["metadata"]["name"] not in exited):
                            due[p["metadata"]["namespace"]].append(p["metadata"]["name"])
                    for ns, pod_names in due.items():
                        cp.exit(ns, pod_names, 0)
                        exited.update(pod_names)

                def phases() -> collections.Counter[str]:
                    return collections.Counter((x.get("status") or {}).get("phase") for x in api.items(RLX_ALL))

                def settled() -> bool:
                    finish_trainers()
                    p = phases()
                    return p.get("Running", 0) == len(running) and p.get("Succeeded", 0) == len(finished)

                wait(f"{len(running)} Running and {len(finished)} Succeeded", settled, args.setup_timeout, op)
                steady_after, wall_steady = time.monotonic() - t_create, time.time()
                cpu_startup = proc_stats(pid)[0] - cpu_create
                print(f"steady phases {steady_after:.0f}s after the first create: {dict(phases())}; the operator used {cpu_startup:.0f} CPU-s "
                      f"by then ({100 * cpu_startup / steady_after:.0f}% of a core); settling {args.settle:.0f}s", flush=True)
                time.sleep(args.settle)

                others = {name: proc.pid for name, proc in cp.procs}
                before = {name: proc_stats(p) for name, p in others.items()}
                cpu0, _, _ = proc_stats(pid)
                log0 = len(log_lines(op.log_path))
                ticks0 = monitor_ticks(op)
                t0 = time.time()
                time.sleep(args.measure)
                t1 = time.time()
                cpu1, rss1, peak = proc_stats(pid)
                ticks = monitor_ticks(op) - ticks0
                after = {name: proc_stats(p) for name, p in others.items()}
                log_window = log_lines(op.log_path)[log0:]
                bus = tcp_connections(pid, urlparse(bus_url).port or 4222) if bus_url else None
                looked_up = None if bus_url else lookups(lookups_file, t0, t1)
                loop.call_soon_threadsafe(stop.set)
                if writer is not None:
                    writer.join(30)
                final = phases()
                alive = op.alive
                time.sleep(2)  # the audit log's last lines written
                mine = [e for e in cp.audit_events() if e["user"]["username"] == user]
                events = [e for e in mine if t0 <= parse_time(e["requestReceivedTimestamp"]) < t1]
                open_watches = watches_open(mine, t1)
                startup = sum(1 for e in mine if e["stage"] == "ResponseComplete" and e["verb"] != "watch"
                              and wall_create <= parse_time(e["requestReceivedTimestamp"]) < wall_steady)
                components = {name: (after[name][0] - before[name][0], after[name][1], after[name][2]) for name in others}
        print(f"\n=== operator at scale on the local control plane: N={args.n} ({len(running)} running, {len(finished)} finished; "
              f"{len(gpus)} on GPUs, {len(gpus & finished)} of them finished), bus {args.bus}, namespaces {namespaces}, "
              f"measured {t1 - t0:.0f}s of steady state ===")
        print(f"room added: {room}")
        report(args, events, open_watches, finished, len(running), t1 - t0, cpu1 - cpu0, (rss0, rss1, peak), final, alive, bus,
               components, (steady_after, startup), time.monotonic() - t_start)
        print(f"monitor ticks that did work:           {ticks / (t1 - t0):8.2f}/s   one per {(t1 - t0) * len(running) / max(ticks, 1):.1f} s per "
              f"running experiment (interval {timings['KUBERL_OPERATOR_INTERVAL']:.0f} s)")
        report_embedded(looked_up, log_window, finished, gpus, namespace_of, len(running), t1 - t0, args.unreachable_bus)
    finally:
        if nats_server is not None:
            nats_server.stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report_embedded(looked_up: list[tuple[float, str]] | None, log_window: list[str], finished: set[str], gpus: set[str],
                    namespace_of: dict[str, str], running: int, seconds: float, unreachable: str) -> None:
    """The failed bus lookups (embedded buses: none resolves here) and the operator's log lines in the window."""
    if looked_up is not None:
        named = naming(finished)
        per_host: dict[str, list[float]] = collections.defaultdict(list)
        for stamp, host in looked_up:
            per_host[host].append(stamp)
        experiments = {h.split("-bus.", 1)[0] for h in per_host}
        # A failed connect is a burst of lookups (nats-py retries the server once, reconnect_time_wait 2 s later): the
        # bursts start where the gap to the previous lookup of that host is over 3 s.
        gaps = sorted(b - a for stamps in per_host.values() for a, b in zip(stamps, stamps[1:], strict=False) if b - a > 3)
        bursts = sum(1 + sum(1 for a, b in zip(stamps, stamps[1:], strict=False) if b - a > 3) for stamps in per_host.values())
        per = max(running, 1)
        why = "connection refused" if unreachable == "refused" else "no cluster DNS"
        print(f"bus lookups (failing: {why}): {len(looked_up) / seconds:8.2f}/s   {len(looked_up) / seconds / per:.3f}/s per running "
              f"experiment, {len(per_host)} hosts ({len(experiments & gpus)} GPU experiments'); naming a finished one: "
              f"{sum(len(v) for h, v in per_host.items() if named and named.search(h))}")
        print(f"  failed connects (bursts of lookups):  {bursts / seconds:8.2f}/s   {len(looked_up) / max(bursts, 1):.1f} lookups each, "
              f"one per {seconds * len(per_host) / max(bursts, 1):.1f} s per experiment; median gap between them "
              f"{gaps[len(gaps) // 2] if gaps else float('nan'):.1f} s")
        by_ns = collections.Counter(namespace_of.get(h.split("-bus.", 1)[0], "?") for _, h in looked_up)
        print("  by namespace: " + ", ".join(f"{k} {v}" for k, v in sorted(by_ns.items())))
    levels: collections.Counter[str] = collections.Counter()
    shapes: collections.Counter[str] = collections.Counter()
    for line in log_window:
        level = re.search(r'"severity": "(\w+)"', line)
        levels[level.group(1) if level else "?"] += 1
        shapes[re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", line)[:160]] += 1
    print(f"operator log lines in the window:      {len(log_window):8d}   ({len(log_window) / seconds:.2f}/s) by severity: {dict(levels)}")
    for shape, count in shapes.most_common(3):
        print(f"  {count:5d} x {shape}")


def naming(finished: set[str]) -> re.Pattern[str] | None:
    """What matches a request that named a finished experiment or one of its children (s0001, s0001-trainer, ...) in
    its object name or URI (a label selector too)."""
    return re.compile(r"(?<![a-z0-9])(?:" + "|".join(sorted(finished)) + r")(?![0-9])") if finished else None


def watches_open(events: list[dict[str, Any]], at: float) -> collections.Counter[str]:
    """The watches (by resource) started before `at` and not ended by then."""
    started = {e["auditID"]: (e.get("objectRef") or {}).get("resource", "?") for e in events
               if e["verb"] == "watch" and e["stage"] == "ResponseStarted" and parse_time(e["stageTimestamp"]) < at}
    for e in events:
        if e["verb"] == "watch" and e["stage"] != "ResponseStarted" and parse_time(e["stageTimestamp"]) < at:
            started.pop(e["auditID"], None)
    return collections.Counter(started.values())


def report(args: argparse.Namespace, events: list[dict[str, Any]], open_watches: collections.Counter[str], finished: set[str],
           running: int, seconds: float, cpu: float,
           rss: tuple[int, int, int], phases: collections.Counter[str], alive: bool, bus: int | None,
           components: dict[str, tuple[float, int, int]], startup: tuple[float, int], whole: float) -> None:
    (rss0, rss1, peak), (steady_after, startup_requests) = rss, startup
    made: collections.Counter[tuple[str, str]] = collections.Counter()
    watches: collections.Counter[str] = collections.Counter()
    spaces: collections.Counter[str] = collections.Counter()
    touched_finished, named = 0, naming(finished)
    for e in events:
        ref = e.get("objectRef") or {}
        resource = ref.get("resource", e.get("requestURI", "?")) + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        if e["verb"] == "watch":
            if e["stage"] == "ResponseStarted":
                watches[resource] += 1
            continue
        if e["stage"] not in ("ResponseComplete", "Panic"):
            continue
        made[(e["verb"].upper(), resource)] += 1
        spaces[ref.get("namespace") or ""] += 1
        touched_finished += bool(named and (named.search(ref.get("name") or "") or named.search(e.get("requestURI", ""))))
    verbs: collections.Counter[str] = collections.Counter()
    for (verb, _), count in made.items():
        verbs[verb] += count
    total = sum(made.values())
    leases = sum(v for (_, r), v in made.items() if r == "leases")
    writes = sum(v for (verb, r), v in made.items() if r == "rlexperiments/status" and verb in ("PATCH", "UPDATE"))
    per = max(running, 1)
    print(f"phases at the end: {dict(phases)}; operator alive: {alive}; whole run {whole / 60:.1f} min")
    print(f"start-up: steady phases {steady_after:.0f}s after the first create; the operator made {startup_requests} requests by then "
          f"({startup_requests / args.n:.1f} per experiment)")
    print(f"API requests/s (operator):             {total / seconds:8.2f}   by verb: "
          + ", ".join(f"{k} {v / seconds:.2f}" for k, v in sorted(verbs.items()))
          + f"   (+{sum(watches.values())} watches started" + "".join(f", {r} {v}" for r, v in watches.most_common()) + ")")
    print(f"watches open at the end (long-lived):  {sum(open_watches.values()):8d}   "
          + ", ".join(f"{r} {v}" for r, v in sorted(open_watches.items())))
    print(f"  of which the Lease (leader election):  {leases / seconds:8.2f}   (does not grow with N)")
    print(f"API requests/s per running experiment: {total / seconds / per:8.4f}   ({(total - leases) / seconds / per:.4f} without the Lease; target <= 0.2)")
    print(f"status writes/s (operator):            {writes / seconds:8.2f}")
    print(f"status writes per 30 s per running:    {writes / seconds * 30 / per:8.3f}   (target <= 1)")
    print(f"requests naming a finished experiment: {touched_finished:8d}   (target 0)")
    print(f"operator CPU:                          {100 * cpu / seconds:8.1f} % of one core   {1000 * cpu / seconds / args.n:.3f} ms/s per experiment")
    print(f"operator RSS:                          {rss1 / 2**20:8.1f} MiB   ({(rss1 - rss0) / args.n / 1024:.1f} KiB per experiment over "
          f"{rss0 / 2**20:.1f} MiB with none; peak {peak / 2**20:.1f} MiB)")
    if bus is not None:
        print(f"bus connections (operator to NATS):    {bus:8d}")
    print("requests by namespace: " + ", ".join(f"{k or '(cluster)'} {v}" for k, v in sorted(spaces.items())))
    print("requests by verb and resource: " + ", ".join(f"{k} {r} {v}" for (k, r), v in made.most_common()))
    for name, (c, rss, peak) in components.items():
        print(f"{name:24s} CPU {100 * c / seconds:5.1f} % of one core   RSS {rss / 2**20:7.1f} MiB (peak {peak / 2**20:.1f} MiB)")
    ok = (total - leases) / seconds / per <= 0.2 and writes / seconds * 30 / per <= 1 and touched_finished == 0
    print(f"target met: {ok}")


if __name__ == "__main__":
    sys.exit(main())
