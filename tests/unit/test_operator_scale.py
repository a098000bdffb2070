"""The operator at scale (issue 11): observedGeneration never lags or moves backwards, a monitor tick of a
running experiment reads the watch caches (no API call), progress reaches status at most every 30 s,
finished and suspended experiments cost nothing, and one NATS connection per bus serves every experiment.

The kopf handlers run directly against the strict API emulator (as test_operator_upgrade.py does),
which counts every request the operator makes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator.cache import Children, slim_pod, slim_workload
from kuberl.operator.kube import KubeClient
from kuberl.operator.progress import BusReader, kv_bucket
from kuberl.operator.rules import at_rest, status_write_due
from kuberl.testing.emulator_server import EmulatorServer, cpu_node, default_crds
from tests.unit.operator_run import run

NS = "scale"
LOG = logging.getLogger("test")


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorServer]:
    with EmulatorServer(default_crds(), namespaces=("default", NS), nodes=[cpu_node("n0", extra={"nvidia.com/gpu": "8"})]) as server:
        yield server


class CountingBus:
    """The operator's bus reader: progress with a step that grows on every read; counts reads."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self, url, token, experiment, key="progress", *, run=""):
        self.reads += 1
        return {"step": self.reads, "total_steps": 1000, "epoch": 0, "policy_version": self.reads, "time": time.time()}

    async def request_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        return False

    async def close(self) -> None:
        return None


@pytest.fixture
def operator(emu: EmulatorServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBus]:
    bus = CountingBus()
    monkeypatch.setattr(h.CONFIG, "kube", KubeClient(emu.url))
    monkeypatch.setattr(h.CONFIG, "bus", bus)
    monkeypatch.setattr(h.CONFIG, "cache", None)
    monkeypatch.setattr(h.CONFIG, "status_interval", 30.0)
    yield bus



def requests(emu: EmulatorServer) -> list[tuple[str, str]]:
    return emu.call(lambda e: [(str(getattr(r.method, "value", r.method)).upper(), r.url.path) for r in e._requests])


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    base = {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"},
            "rollout": {"replicas": 1, "accelerator": {"type": "cpu", "count": 0}},
            "trainer": {"accelerator": {"type": "cpu", "count": 1}}, "training": {"totalSteps": 1000}}
    for key, value in spec.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) and isinstance(value, dict) else value
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": NS}, "spec": base}


def create(m: dict[str, Any]) -> None:
    run(h.kube().request("POST", f"/apis/kuberl.io/v1alpha1/namespaces/{NS}/rlexperiments", body=m))


def get(kind: str, name: str) -> dict[str, Any]:
    return run(h.kube().get(kind, NS, name))


def reconcile(name: str, memo: Any, body: dict[str, Any] | None = None) -> None:
    body = body or get("RLExperiment", name)
    run(handlers.on_reconcile(body=body, status=body.get("status") or {}, memo=memo, logger=LOG))


def tick(body: dict[str, Any], memo: Any, **kwargs: Any) -> None:
    run(handlers.monitor(body=body, status=body.get("status") or {}, memo=memo, logger=LOG, **kwargs))


def make_running(name: str) -> None:
    """Play the controllers: every workload of the experiment up."""
    for sts in (f"{name}-bus", f"{name}-rollout"):
        n = get("StatefulSet", sts)["spec"]["replicas"]
        run(h.kube().patch_status("StatefulSet", NS, sts, {"replicas": n, "readyReplicas": n, "availableReplicas": n}))
    run(h.kube().patch_status("Job", NS, f"{name}-trainer", {"active": 1, "ready": 1}))


def cache_of(name: str) -> Children:
    """The watch caches as kopf's indexes would hold them for this experiment (key -> store of values)."""
    pods = {(NS, name): []}
    sts = {(NS, n): [slim_workload(get("StatefulSet", n))] for n in (f"{name}-bus", f"{name}-rollout")}
    jobs = {(NS, f"{name}-trainer"): [slim_workload(get("Job", f"{name}-trainer"))]}
    return Children(pods, sts, jobs)


class TestObservedGeneration:
    def test_the_operators_own_replicas_write_is_the_generation_it_reconciles(self, emu, operator) -> None:
        """The reconcile writes spec.rollout.replicas (allocation's d) itself, which bumps the generation:
        observedGeneration names that generation at once (it used to stay one behind)."""
        m = manifest("og1", allocation="vllm:d2+fsdp:d4", rollout={"accelerator": {"type": "nvidia"}},
                     trainer={"accelerator": {"type": "nvidia", "count": 4}})
        del m["spec"]["rollout"]["replicas"]
        create(m)
        reconcile("og1", kopf.Memo())
        exp = get("RLExperiment", "og1")
        assert exp["spec"]["rollout"]["replicas"] == 2
        assert exp["status"]["observedGeneration"] == exp["metadata"]["generation"] == 2

    def test_a_monitor_tick_that_started_before_a_reconcile_never_moves_observed_generation_back(self, emu, operator) -> None:
        """The timer's status is a snapshot from when kopf called it; its write must not put back the
        observedGeneration the reconcile has moved on since (the module-run failure of test_operator)."""
        create(manifest("og2"))
        memo = kopf.Memo()
        reconcile("og2", memo)
        stale = get("RLExperiment", "og2")
        assert stale["status"]["observedGeneration"] == 1
        run(h.kube().patch("RLExperiment", NS, "og2", {"spec": {"rollout": {"replicas": 2}}}))
        reconcile("og2", memo)
        assert get("RLExperiment", "og2")["status"]["observedGeneration"] == 2
        make_running("og2")  # so the stale tick has something to write
        tick(stale, memo)
        exp = get("RLExperiment", "og2")
        assert exp["status"]["phase"] == "Running", exp["status"]
        assert exp["status"]["observedGeneration"] == 2 == exp["metadata"]["generation"]
        reconciled = next(c for c in exp["status"]["conditions"] if c["type"] == "Reconciled")
        assert reconciled["observedGeneration"] == 2 and reconciled["status"] == "True"


class TestSteadyState:
    def test_a_running_experiment_reads_no_api_on_a_tick_and_writes_progress_at_most_every_30s(self, emu, operator) -> None:
        create(manifest("ss1"))
        memo = kopf.Memo()
        reconcile("ss1", memo)
        make_running("ss1")
        h.CONFIG.cache = cache_of("ss1")
        body = get("RLExperiment", "ss1")
        tick(body, memo)  # the phase changes to Running: written at once
        assert get("RLExperiment", "ss1")["status"]["phase"] == "Running"
        before = len(requests(emu))
        for _ in range(10):  # progress changes on every tick
            tick(body, memo)
        made = requests(emu)[before:]
        assert operator.reads >= 11
        assert made == [], f"a steady tick made API requests: {made}"
        memo["status_written_at"] -= 31  # 30 s later
        tick(body, memo)
        made = requests(emu)[before:]
        assert [m for m, _ in made] == ["PATCH"] and made[0][1].endswith("/ss1/status"), made
        assert get("RLExperiment", "ss1")["status"]["progress"]["step"] == operator.reads

    def test_the_write_rule_throttles_progress_only(self) -> None:
        old = {"phase": "Running", "progress": {"step": 1}, "observedGeneration": 1}
        assert not status_write_due(old, dict(old), 0.0, 100.0, 30)
        assert not status_write_due(old, {**old, "progress": {"step": 2}}, 90.0, 100.0, 30)
        assert status_write_due(old, {**old, "progress": {"step": 2}}, 70.0, 100.0, 30)
        assert status_write_due(old, {**old, "progress": {"step": 2}}, None, 100.0, 30)
        assert status_write_due(old, {**old, "phase": "Succeeded"}, 99.0, 100.0, 30)
        assert status_write_due(old, {**old, "observedGeneration": 2}, 99.0, 100.0, 30)


class TestAtRest:
    def succeeded(self, name: str, memo: Any) -> dict[str, Any]:
        create(manifest(name))
        reconcile(name, memo)
        make_running(name)
        run(h.kube().patch_status("Job", NS, f"{name}-trainer", {"active": 0, "ready": 0, "succeeded": 1, "conditions": [
            {"type": "Complete", "status": "True", "reason": "Completed", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}))
        tick(get("RLExperiment", name), memo)
        body = get("RLExperiment", name)
        assert body["status"]["phase"] == "Succeeded"
        return body

    def test_a_finished_experiment_costs_no_api_call_no_bus_read_and_no_status_write(self, emu, operator) -> None:
        memo = kopf.Memo()
        body = self.succeeded("fin1", memo)
        assert at_rest(body, body["status"])
        before, reads = len(requests(emu)), operator.reads
        for _ in range(5):
            tick(body, memo)
        assert requests(emu)[before:] == [] and operator.reads == reads

    def test_a_finished_experiment_is_still_deleted_after_its_ttl(self, emu, operator) -> None:
        memo = kopf.Memo()
        body = self.succeeded("fin2", memo)
        body["spec"]["ttlSecondsAfterFinished"] = 1
        memo["status"] = {**memo["status"], "completionTime": "2026-01-01T00:00:00Z"}  # long ago
        tick(body, memo)
        assert run(h.kube().get("RLExperiment", NS, "fin2")) is None or get("RLExperiment", "fin2")["metadata"].get("deletionTimestamp")

    @pytest.mark.parametrize(("status", "spec", "rest"), [
        ({"phase": "Succeeded"}, {}, True),
        ({"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": "MaxRestartsExceeded"}]}, {}, True),
        ({"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": "ValidationFailed"}]}, {}, False),
        ({"phase": "Suspended", "conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}, {"suspend": True}, True),
        ({"phase": "Suspended", "conditions": [{"type": "Suspended", "status": "True", "reason": "Suspending"}]}, {"suspend": True}, False),
        ({"phase": "Running"}, {}, False),
    ])
    def test_at_rest_only_when_over_or_fully_suspended_and_reconciled(self, status, spec, rest) -> None:
        body = {"metadata": {"generation": 4}, "spec": spec}
        assert at_rest(body, {**status, "observedGeneration": 4}) is rest
        assert not at_rest(body, {**status, "observedGeneration": 3}), "a spec edit not reconciled yet is watched"


class TestCaches:
    def test_the_cached_values_keep_what_status_reads_and_drop_the_templates(self, emu, operator) -> None:
        create(manifest("c1"))
        reconcile("c1", kopf.Memo())
        job = get("Job", "c1-trainer")
        slim = slim_workload(job)
        assert slim["spec"] == {k: v for k, v in job["spec"].items() if k != "template"} and "parallelism" in slim["spec"]
        assert slim["metadata"]["uid"] == job["metadata"]["uid"] and "managedFields" not in slim["metadata"]
        pod = {"metadata": {"name": "p", "labels": {"a": "b"}, "managedFields": [1]},
               "spec": {"containers": [{"name": "x", "image": "i", "env": [1]}]}, "status": {"phase": "Pending"}}
        assert slim_pod(pod) == {"metadata": {"name": "p", "labels": {"a": "b"}}, "spec": {"containers": [{"name": "x", "image": "i"}]},
                                 "status": {"phase": "Pending"}}


class TestBusReader:
    def test_every_experiment_on_one_bus_shares_one_connection_and_each_bucket_is_looked_up_once(self, tmp_path) -> None:
        from kuberl.runtime.bus.server import start_nats_server

        server = start_nats_server(store_dir=str(tmp_path / "store"))

        async def main() -> tuple[int, int, list[Any]]:
            import nats

            nc = await nats.connect(server.url)
            for i in range(20):
                kv = await nc.jetstream().create_key_value(bucket=kv_bucket(f"e{i}", "r"))
                await kv.put("progress", b'{"step": %d}' % i)
            await nc.close()
            reader = BusReader()
            lookups = 0
            real = nats.js.JetStreamContext.key_value

            async def counted(self: Any, bucket: str) -> Any:
                nonlocal lookups
                lookups += 1
                return await real(self, bucket)

            nats.js.JetStreamContext.key_value = counted
            try:
                first = await asyncio.gather(*(reader.read(server.url, None, f"e{i}", run="r") for i in range(20)))
                again = await asyncio.gather(*(reader.read(server.url, None, f"e{i}", run="r") for i in range(20)))
            finally:
                nats.js.JetStreamContext.key_value = real
                conns = reader.open_connections()
                await reader.close()
            assert [v["step"] for v in first] == list(range(20)) == [v["step"] for v in again]
            return reader.connects, conns, [lookups]

        try:
            connects, conns, [lookups] = asyncio.run(main())
        finally:
            server.stop()
        assert (connects, conns) == (1, 1)
        assert lookups == 20, "each bucket's KV handle is kept: a read is one round trip"

    def test_a_bus_that_hangs_on_connect_delays_no_other_bus(self, monkeypatch) -> None:
        import nats

        hang = asyncio.Event()

        class Conn:
            is_connected = True

            def jetstream(self) -> Any:
                class Js:
                    async def key_value(self, bucket: str) -> Any:
                        class Kv:
                            async def get(self, key: str) -> Any:
                                return type("Entry", (), {"value": b'{"step": 7}'})()
                        return Kv()
                return Js()

        async def connect(url: str, **_: Any) -> Any:
            if "dead" in url:
                await hang.wait()  # a connect that neither succeeds nor fails (traffic dropped)
            return Conn()

        monkeypatch.setattr(nats, "connect", connect)

        async def main() -> Any:
            reader = BusReader(connect_timeout=60)
            stuck = asyncio.create_task(reader.read("nats://dead:4222", None, "a"))
            await asyncio.sleep(0.05)
            try:
                return await asyncio.wait_for(reader.read("nats://alive:4222", None, "b"), timeout=2)
            finally:
                hang.set()
                await stuck

        assert asyncio.run(main()) == {"step": 7}


class TestWatches:
    def test_the_children_and_workload_watches_are_filtered_on_the_experiment_label_by_the_server(self) -> None:
        from kopf._cogs.structs.references import Resource

        from kuberl.operator.main import configure_settings

        settings = kopf.OperatorSettings()
        configure_settings(settings, standalone=True, clusterwide=True)
        for group, version, plural in (("", "v1", "pods"), ("apps", "v1", "statefulsets"), ("batch", "v1", "jobs"),
                                       ("kueue.x-k8s.io", "v1beta1", "workloads")):
            resource = Resource(group=group, version=version, plural=plural)
            assert list(settings.watching.label_selectors.collect(resource)) == ["kuberl.io/experiment"], plural
        assert not list(settings.watching.label_selectors.collect(Resource(group="kuberl.io", version="v1alpha1", plural="rlexperiments")))


class TestReconcileSlots:
    def test_no_more_reconciles_apply_at_once_than_the_limit(self, monkeypatch) -> None:
        monkeypatch.setattr(h.CONFIG, "max_reconciles", 2)
        running, most = 0, 0

        async def fake(body, status, memo, logger) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0.05)
            running -= 1

        monkeypatch.setattr(handlers, "_reconcile", fake)

        async def main() -> None:
            bodies = [manifest(f"slot{i}") for i in range(6)]
            await asyncio.gather(*(handlers.on_reconcile(body=b, status={}, memo=kopf.Memo(), logger=LOG) for b in bodies))

        asyncio.run(main())
        assert most == 2

    def test_a_bad_limit_is_a_clear_error(self, monkeypatch) -> None:
        monkeypatch.setenv("KUBERL_OPERATOR_MAX_RECONCILES", "0")
        with pytest.raises(ValueError, match="KUBERL_OPERATOR_MAX_RECONCILES must be a positive integer"):
            h.env_count("KUBERL_OPERATOR_MAX_RECONCILES", 16)
