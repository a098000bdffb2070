"""The operator at scale (issue 11), its pure parts: the status write throttle, when an experiment is at rest, one
NATS connection per bus for every experiment, the server-side filters of the watches and the reconcile slots.

What the handlers ask of the API server (observedGeneration, no API call on a steady tick, nothing for a finished
experiment) is tested against the real control plane in tests/integration/test_operator_api_cost.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
import pytest

from kuberl.operator import handlers
from kuberl.operator import lifecycle as h
from kuberl.operator.progress import BusReader, kv_bucket
from kuberl.operator.rules import at_rest, status_write_due

LOG = logging.getLogger("test")


def manifest(name: str) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name, "namespace": "scale"},
            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}}}


class TestSteadyState:
    def test_the_write_rule_throttles_progress_only(self) -> None:
        old = {"phase": "Running", "progress": {"step": 1}, "observedGeneration": 1}
        assert not status_write_due(old, dict(old), 0.0, 100.0, 30)
        assert not status_write_due(old, {**old, "progress": {"step": 2}}, 90.0, 100.0, 30)
        assert status_write_due(old, {**old, "progress": {"step": 2}}, 70.0, 100.0, 30)
        assert status_write_due(old, {**old, "progress": {"step": 2}}, None, 100.0, 30)
        assert status_write_due(old, {**old, "phase": "Succeeded"}, 99.0, 100.0, 30)
        assert status_write_due(old, {**old, "observedGeneration": 2}, 99.0, 100.0, 30)


class TestAtRest:
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
    def test_a_cached_pod_keeps_what_status_reads(self) -> None:
        from kuberl.operator.cache import slim_pod

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
    def test_the_children_and_workload_watches_are_filtered_by_the_server(self) -> None:
        from kopf._cogs.structs.references import Resource

        from kuberl.operator.main import configure_settings

        settings = kopf.OperatorSettings()
        configure_settings(settings, standalone=True, clusterwide=True)
        for group, version, plural in (("apps", "v1", "statefulsets"), ("batch", "v1", "jobs"), ("kueue.x-k8s.io", "v1beta1", "workloads")):
            resource = Resource(group=group, version=version, plural=plural)
            assert list(settings.watching.label_selectors.collect(resource)) == ["kuberl.io/experiment"], plural
        # Pods: the roles' (kuberl.io/experiment) and the tool sandbox's (kuberl.io/sandbox) both carry managed-by
        # (tests/unit/test_sandbox_pod.py checks every pod template against it).
        pods = Resource(group="", version="v1", plural="pods")
        assert list(settings.watching.label_selectors.collect(pods)) == ["app.kubernetes.io/managed-by=kuberl-operator"]
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
