"""The operator at scale: N RLExperiments on the real local control plane, steady-state cost per experiment.

Run: `python bench/bench_operator_scale.py --n 100` (and `--n 300`, `--n 500`). Starts the local control plane
(kuberl.testing.control_plane: etcd, kube-apiserver, controller manager, scheduler, and KWOK nodes whose pods run
without containers; `bash scripts/install-control-plane.sh` builds it once), `helm install`s charts/kuberl with its
defaults (replicaCount 0: no image) and runs the operator here as the chart's Deployment runs it: the chart's
ServiceAccount and RBAC, its args (leader election on) and environment, the operator's own defaults for what the
chart leaves unset (monitor every 5 s). A real nats-server is shared by every experiment (spec.bus.external).

It creates N experiments in `default` (the chart's tenant namespace) with enough PersistentVolumes for their
checkpoint claims and enough fake nodes for their pods; the StatefulSet and Job controllers, the scheduler and KWOK
bring the pods up. `--finished` of them finish: their trainer pods exit 0 (ControlPlane.exit), so the Job completes.
It writes bus progress with a growing step for every running one, waits for the steady state, then measures for
`--measure` seconds while it touches the API itself no more.

The operator's requests are counted from the API server's audit log (every request of the chart's ServiceAccount).
Printed: the operator's API requests/s (by verb and resource; watches are long-lived and listed apart), status
writes/s, the requests that named a finished experiment, the operator's CPU and RSS (per experiment over the RSS
before any experiment existed), the bus connections it holds, and the CPU and memory of the API server and etcd.
Issue 11's target per running experiment: <= 0.2 API requests/s and <= 1 status write per 30 s; none for finished ones.
Not a test: the figures depend on the machine; tests/unit/test_operator_scale.py and
tests/integration/test_operator_api_cost.py check the rules. On a 2-core VM (2026-12-02, not quiet: a test suite ran
beside it) a whole run took 4.5 min at --n 100, 9.2 min at --n 300 and 11.4 min at --n 500, most of it the start-up
reconcile of every experiment (docs/benchmarks.md#the-operator-at-scale has the figures). It needs about 2.5 GiB of
memory in all at --n 500 (the API server's peak 1.3 GiB). `--keep` keeps the control plane's logs, its audit log and the
operator's log.
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
RELEASE, OPERATOR_NAMESPACE, NS = "kuberl", "kuberl-system", "default"
RLX = f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments"
BUS_RUN = "kuberl.io/bus-run"
PODS_PER_NODE = 110


def manifest(name: str, bus_url: str) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
                     "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
                     "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "training": {"totalSteps": 100000},
                     "bus": {"external": {"url": bus_url}}}}


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


def install_chart(cp: Any, tmp: Path) -> dict[str, Any]:
    """`helm install` the chart with its defaults but no replica (as the root conftest.py does); its Deployment."""
    env = {**os.environ, "KUBECONFIG": cp.kubeconfig, "PATH": f"{cp.bin}{os.pathsep}{os.environ.get('PATH', '')}",
           **{f"HELM_{k}_HOME": str(tmp / f"helm-{k.lower()}") for k in ("CACHE", "CONFIG", "DATA")}}
    out = subprocess.run(["helm", "install", RELEASE, str(ROOT / "charts" / "kuberl"), "--namespace", OPERATOR_NAMESPACE,
                          "--create-namespace", "--set", "replicaCount=0", "--wait", "--timeout", "3m"],
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


def add_room(cp: Any, n: int, bus_url: str) -> None:
    """Fake nodes for 2 pods per experiment (a rollout pod and a trainer pod) beyond the control plane's CPU pool, and
    a PersistentVolume of the default class for every checkpoint claim (no provisioner runs), of the access mode the
    operator asks for (`kuberl render`'s PersistentVolumeClaim)."""
    from kuberl.operator.render import render
    from kuberl.testing.control_plane import STORAGE_CLASS

    modes = {m for o in render(manifest("s0000", bus_url)) if o["kind"] == "PersistentVolumeClaim" for m in o["spec"]["accessModes"]}

    nodes = math.ceil(2 * n / PODS_PER_NODE)
    cp.add_nodes({"bench": (nodes, {"kuberl.test/pool": "cpu"}, [],
                            {"cpu": "256", "memory": "2048Gi", "ephemeral-storage": "10Ti", "pods": str(PODS_PER_NODE)})})
    pvs = [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"bench-{mode.lower()}-{i}"},
            "spec": {"capacity": {"storage": "16Ti"}, "accessModes": [mode], "storageClassName": STORAGE_CLASS,
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/kuberl-fake-volumes/bench-{mode.lower()}-{i}"}}}
           for mode in sorted(modes) for i in range(n)]
    for i in range(0, len(pvs), 200):
        cp.apply(*pvs[i:i + 200])


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Target per running experiment: <= 0.2 API requests/s, <= 1 status write per 30 s; none for finished ones.")
    ap.add_argument("--n", type=int, default=100, help="experiments (default 100)")
    ap.add_argument("--finished", type=float, default=0.2, help="fraction of them whose trainer has completed (default 0.2)")
    ap.add_argument("--measure", type=float, default=90.0, help="seconds of steady state measured (default 90: three status periods)")
    ap.add_argument("--settle", type=float, default=40.0, help="seconds waited once every phase is right, before measuring (default 40)")
    ap.add_argument("--progress-every", type=float, default=5.0, help="seconds between bus progress writes per experiment (default 5)")
    ap.add_argument("--setup-timeout", type=float, default=900.0, help="seconds allowed for each wait while setting up (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (control plane logs, audit log, operator log)")
    args = ap.parse_args(argv)
    if args.n < 1 or not 0 <= args.finished < 1 or args.measure <= 0:
        ap.error("--n must be >= 1, --finished in [0, 1), --measure > 0")

    from kuberl.runtime.bus.server import start_nats_server
    from kuberl.testing.control_plane import ControlPlane
    from kuberl.testing.operator_process import OperatorProcess

    tmp = Path(tempfile.mkdtemp(prefix="kuberl-bench-operator-"))
    t_start = time.monotonic()
    # Every request of a ServiceAccount of the operator's namespace, on any resource (the default policy records only
    # KubeRL's and Kueue's resources); filtered below to the chart's ServiceAccount.
    rules = [{"level": "Metadata", "userGroups": [f"system:serviceaccounts:{OPERATOR_NAMESPACE}"]}]
    nats_server = start_nats_server(store_dir=str(tmp / "nats"))
    try:
        with ControlPlane(tmp / "control-plane", audit_rules=rules) as cp:
            print(f"control plane up in {cp.start_seconds:.0f}s", flush=True)
            api = Api(cp)
            deployment = install_chart(cp, tmp)
            add_room(cp, args.n, nats_server.url)
            op_args, env, timings = operator_settings(deployment)
            sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"
            kubeconfig = cp.kubeconfig_for(sa, OPERATOR_NAMESPACE, tmp / "operator.kubeconfig")
            pod_name = f"{RELEASE}-bench-0"
            env |= {"POD_NAME": pod_name, "POD_NAMESPACE": OPERATOR_NAMESPACE}  # the Deployment's fieldRefs
            print(f"chart installed, operator args {op_args}, {timings} after {time.monotonic() - t_start:.0f}s", flush=True)
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
                names = [f"s{i:04d}" for i in range(args.n)]
                finished = set(names[: int(args.n * args.finished)])
                running = [n for n in names if n not in finished]
                t_create, wall_create = time.monotonic(), time.time()
                for name in names:
                    api.call("POST", RLX, manifest(name, nats_server.url))
                print(f"created {args.n} experiments in {time.monotonic() - t_create:.0f}s ({time.monotonic() - t_start:.0f}s from the start)",
                      flush=True)

                def reconciled() -> bool:
                    xs = api.items(RLX)
                    done = sum(1 for x in xs if (x.get("status") or {}).get("observedGeneration") == x["metadata"]["generation"])
                    return done == args.n and all(x["metadata"].get("annotations", {}).get(BUS_RUN) for x in xs)

                wait("every experiment reconciled", reconciled, args.setup_timeout, op)
                print(f"reconciled {time.monotonic() - t_create:.0f}s after the first create", flush=True)
                runs = {x["metadata"]["name"]: x["metadata"]["annotations"][BUS_RUN] for x in api.items(RLX)}
                stop = asyncio.Event()
                loop = asyncio.new_event_loop()
                writer = threading.Thread(target=loop.run_until_complete, daemon=True,
                                          args=(write_progress(nats_server.url, {n: runs[n] for n in running}, stop, args.progress_every),))
                writer.start()
                exited: set[str] = set()

                def finish_trainers() -> None:
                    """The finished experiments' trainer pods exit 0 once they run (KWOK plays it)."""
                    pods = api.items(f"/api/v1/namespaces/{NS}/pods?labelSelector=kuberl.io/role%3Dtrainer")
                    due = [p["metadata"]["name"] for p in pods if p["metadata"].get("labels", {}).get("kuberl.io/experiment") in finished
                           and (p.get("status") or {}).get("phase") == "Running" and p["metadata"]["name"] not in exited]
                    cp.exit(NS, due, 0)
                    exited.update(due)

                def phases() -> collections.Counter[str]:
                    return collections.Counter((x.get("status") or {}).get("phase") for x in api.items(RLX))

                def settled() -> bool:
                    finish_trainers()
                    p = phases()
                    return p.get("Running", 0) == len(running) and p.get("Succeeded", 0) == len(finished)

                wait(f"{len(running)} Running and {len(finished)} Succeeded", settled, args.setup_timeout, op)
                steady_after, wall_steady = time.monotonic() - t_create, time.time()
                print(f"steady phases {steady_after:.0f}s after the first create: {dict(phases())}; settling {args.settle:.0f}s", flush=True)
                time.sleep(args.settle)

                others = {name: proc.pid for name, proc in cp.procs}
                before = {name: proc_stats(p) for name, p in others.items()}
                cpu0, _, _ = proc_stats(pid)
                t0 = time.time()
                time.sleep(args.measure)
                t1 = time.time()
                cpu1, rss1, peak = proc_stats(pid)
                after = {name: proc_stats(p) for name, p in others.items()}
                bus = tcp_connections(pid, urlparse(nats_server.url).port or 4222)
                loop.call_soon_threadsafe(stop.set)
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
        report(args, events, open_watches, finished, len(running), t1 - t0, cpu1 - cpu0, (rss0, rss1, peak), final, alive, bus,
               components, (steady_after, startup), time.monotonic() - t_start)
    finally:
        nats_server.stop()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


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
           rss: tuple[int, int, int], phases: collections.Counter[str], alive: bool, bus: int,
           components: dict[str, tuple[float, int, int]], startup: tuple[float, int], whole: float) -> None:
    (rss0, rss1, peak), (steady_after, startup_requests) = rss, startup
    made: collections.Counter[tuple[str, str]] = collections.Counter()
    watches: collections.Counter[str] = collections.Counter()
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
        touched_finished += bool(named and (named.search(ref.get("name") or "") or named.search(e.get("requestURI", ""))))
    verbs: collections.Counter[str] = collections.Counter()
    for (verb, _), count in made.items():
        verbs[verb] += count
    total = sum(made.values())
    leases = sum(v for (_, r), v in made.items() if r == "leases")
    writes = sum(v for (verb, r), v in made.items() if r == "rlexperiments/status" and verb in ("PATCH", "UPDATE"))
    per = max(running, 1)
    print(f"\n=== operator at scale on the local control plane: N={args.n} ({running} running, {len(finished)} finished), "
          f"measured {seconds:.0f}s of steady state ===")
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
    print(f"bus connections (operator to NATS):    {bus:8d}")
    print("requests by verb and resource: " + ", ".join(f"{k} {r} {v}" for (k, r), v in made.most_common()))
    for name, (c, rss, peak) in components.items():
        print(f"{name:24s} CPU {100 * c / seconds:5.1f} % of one core   RSS {rss / 2**20:7.1f} MiB (peak {peak / 2**20:.1f} MiB)")
    ok = (total - leases) / seconds / per <= 0.2 and writes / seconds * 30 / per <= 1 and touched_finished == 0
    print(f"target met: {ok}")


if __name__ == "__main__":
    sys.exit(main())
