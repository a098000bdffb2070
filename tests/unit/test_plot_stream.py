"""The metrics stream (kuberl.runtime.bus.metrics) and `kuberl plot <experiment>` (kuberl.runtime.plot_cluster), without a server:

rows -> messages -> rows round trip (one per step, group_ids left out), the publisher never blocking or
raising while the bus fails and catching up after, a fresh start deleting the stream, the names and the
kubectl port-forward command the cluster path uses, and the plot command's errors. The real nats-server:
tests/integration/test_metrics_stream.py; the real control plane: e2e_tests/test_kuberl_plot_cluster.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from kuberl.operator import naming
from kuberl.runtime.bus.metrics import (
    MAX_MSGS,
    MAX_STEPS,
    MetricsError,
    MetricsPublisher,
    decode_rows,
    encode_row,
    read_rows,
    stream_config,
)
from kuberl.runtime.bus.names import BusNames
from kuberl.runtime.plot import PlotError, main
from kuberl.runtime.plot_cluster import bus_endpoint, bus_run, child_name, forwarded_port, port_forward_command


def rows(n: int) -> list[dict[str, Any]]:
    return [{"step": s, "reward_mean": s / n, "entropy": 1.0, "timings": {"train.collect": 0.1}, "group_ids": ["g"]} for s in range(1, n + 1)]


class FakeStream:
    """The JetStream calls the publisher and the reader make, on a list; dedupe by Nats-Msg-Id as the server does."""

    def __init__(self, fail_first: int = 0, exists: bool = True) -> None:
        self.msgs: list[bytes] = []
        self.ids: set[str] = set()
        self.fail_first = fail_first
        self.exists = exists
        self.calls: list[str] = []
        self.publishes = 0

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], timeout: float, stream: str) -> Any:
        self.publishes += 1
        if self.fail_first > 0:
            self.fail_first -= 1
            raise nats.errors.TimeoutError
        assert subject == NAMES.metrics_subject and stream == NAMES.metrics_stream
        dup = headers["Nats-Msg-Id"] in self.ids
        if not dup:
            self.ids.add(headers["Nats-Msg-Id"])
            self.msgs.append(data)
        return SimpleNamespace(duplicate=dup)

    async def stream_info(self, name: str) -> Any:
        self.calls.append(f"info {name}")
        if not self.exists:
            raise nats.js.errors.NotFoundError
        return SimpleNamespace(state=SimpleNamespace(messages=len(self.msgs)))

    async def add_stream(self, cfg: Any) -> None:
        self.calls.append(f"add {cfg.name}")
        self.exists = True

    async def delete_stream(self, name: str) -> None:
        self.calls.append(f"delete {name}")
        if not self.exists:
            raise nats.js.errors.NotFoundError
        self.exists, self.msgs, self.ids = False, [], set()

    async def pull_subscribe(self, subject: str, stream: str, config: Any) -> Any:
        config.name = "reader"
        return FakeSub(list(self.msgs))

    async def delete_consumer(self, stream: str, name: str) -> None:
        self.calls.append(f"delete consumer {name}")


class FakeSub:
    def __init__(self, msgs: list[bytes]) -> None:
        self.left = msgs

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        if not self.left:
            raise nats.errors.TimeoutError
        out, self.left = self.left[:batch], self.left[batch:]
        return [SimpleNamespace(data=d, metadata=SimpleNamespace(num_pending=len(self.left) + len(out) - i - 1)) for i, d in enumerate(out)]

    async def unsubscribe(self) -> None:
        return None


NAMES = BusNames.for_experiment("curve", run="team-a.0123456789ab")


def publisher(js: FakeStream, **kw: Any) -> MetricsPublisher:
    pub = MetricsPublisher(js, NAMES, url="nats://bus:4222", max_payload=1 << 20, max_backoff=0.05, **kw)
    pub._task = asyncio.get_running_loop().create_task(pub._run())
    return pub


# -- the wire format ---------------------------------------------------------------------------------


def test_a_row_is_its_json_without_group_ids_and_is_deduplicated_by_step():
    data, headers = encode_row({"step": 7, "reward_mean": 0.5, "group_ids": ["a", "b"], "eval": {"pass@1": 0.25}})
    assert headers == {"Nats-Msg-Id": "step-7"}
    assert json.loads(data) == {"step": 7, "reward_mean": 0.5, "eval": {"pass@1": 0.25}}


@pytest.mark.parametrize("bad", [{"reward_mean": 1.0}, {"step": "3"}, {"step": True}, {"step": 2.0}])
def test_a_row_without_an_integer_step_is_refused(bad):
    with pytest.raises(ValueError, match="integer step"):
        encode_row(bad)


def test_decoding_keeps_one_row_per_step_the_last_in_step_order():
    msgs = [encode_row(r)[0] for r in rows(3)] + [encode_row({"step": 2, "reward_mean": 9.0})[0]]
    got = decode_rows(reversed(msgs[:3]), "s")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert decode_rows(msgs, "s")[1] == {"step": 2, "reward_mean": 9.0}


@pytest.mark.parametrize("data, message", [(b"{nope", "message 2 is not JSON"), (b"[1]", "message 2 is not a metrics row"),
                                           (b'{"step": null}', "message 2 is not a metrics row")])
def test_a_message_that_is_no_metrics_row_fails_with_its_number(data, message):
    with pytest.raises(MetricsError, match=message):
        decode_rows([b'{"step": 1}', data], "stream S")


def test_the_stream_holds_100k_steps_and_remembers_step_ids_a_day():
    cfg = stream_config(NAMES)
    assert cfg.name == "KUBERL_CURVE_TEAM_A_0123456789AB_METRICS" and cfg.subjects == ["kuberl.team-a.0123456789ab.curve.metrics"]
    assert cfg.max_msgs == MAX_MSGS >= MAX_STEPS == 100_000
    one_row = len(encode_row({**rows(1)[0], "samples_per_second": 1.0, "loss": 0.1, "policy_version": 100_000})[0])
    assert cfg.max_bytes >= MAX_STEPS * max(one_row, 1000)
    assert cfg.discard == "old" and cfg.retention == "limits" and cfg.duplicate_window >= 24 * 3600


# -- publisher -> stream -> reader ---------------------------------------------------------------------


async def test_rows_published_come_back_once_each_in_step_order():
    js = FakeStream(exists=False)
    pub = publisher(js)
    for r in rows(50):
        pub.publish(r)
    pub.publish(rows(50)[9])  # a step published again (a restarted trainer): kept once
    await pub.close()
    assert js.calls[:2] == [f"info {NAMES.metrics_stream}", f"add {NAMES.metrics_stream}"]
    got = await read_rows(js, NAMES)
    assert got == [{k: v for k, v in r.items() if k != "group_ids"} for r in rows(50)]
    assert len(js.msgs) == 50 and pub.published == 51 and pub.pending == 0


async def test_publish_never_blocks_and_a_failing_bus_loses_no_row(caplog):
    js = FakeStream(fail_first=4)
    pub = publisher(js)
    caplog.set_level(logging.WARNING, "kuberl.runtime.bus.metrics")
    started = time.monotonic()
    for r in rows(20):
        pub.publish(r)  # returns at once: the bus is failing
    assert time.monotonic() - started < 0.05
    await pub.close(timeout=5.0)
    assert [json.loads(m)["step"] for m in js.msgs] == list(range(1, 21))
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("cannot publish" in w for w in warnings) == 1 and any("publishing again" in w for w in warnings)


async def test_close_gives_up_after_its_timeout_and_says_what_was_left(caplog):
    js = FakeStream(fail_first=10**9)
    pub = publisher(js)
    for r in rows(3):
        pub.publish(r)
    started = time.monotonic()
    await pub.close(timeout=0.3)
    assert time.monotonic() - started < 2.0
    assert "3 rows (steps 1..3) not published at exit" in caplog.text


async def test_while_the_bus_is_away_the_oldest_rows_beyond_the_limit_are_dropped(caplog):
    pub = publisher(FakeStream(fail_first=10**9), keep=5)
    for r in rows(8):
        pub.publish(r)
    assert pub.pending == 5 and pub.dropped == 3 and [s for s, _, _ in pub._queue] == [4, 5, 6, 7, 8]
    await pub.close(timeout=0.1)


async def test_a_fresh_start_deletes_the_stream_a_resumed_one_keeps_it():
    js = FakeStream()
    js.msgs, js.ids = [b'{"step": 1}'], {"step-1"}  # an earlier run's step 1
    pub = publisher(js)
    pub._fresh = True
    pub.publish({"step": 1, "reward_mean": 0.0})
    await pub.close()
    assert js.calls[0] == f"delete {NAMES.metrics_stream}" and json.loads(js.msgs[0]) == {"step": 1, "reward_mean": 0.0}
    pub = publisher(js)
    pub.publish({"step": 2, "reward_mean": 0.0})
    await pub.close()
    assert [json.loads(m)["step"] for m in js.msgs] == [1, 2] and js.calls.count(f"delete {NAMES.metrics_stream}") == 1


async def test_reading_a_missing_stream_says_no_step_yet():
    with pytest.raises(MetricsError, match="has not reported a step yet"):
        await read_rows(FakeStream(exists=False), NAMES)
    assert await read_rows(FakeStream(), NAMES) == []


# -- the cluster side: names, endpoint, port-forward ---------------------------------------------------


def exp_obj(name: str = "curve", **spec_bus: Any) -> dict[str, Any]:
    return {"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment",
            "metadata": {"name": name, "namespace": "team-a", "uid": "01234567-89ab-cdef-0123-456789abcdef"},
            "spec": {"bus": spec_bus}}


@pytest.mark.parametrize("name", ["curve", "a" * 63, "x-" * 25 + "y"])
def test_the_names_match_the_operators(name):
    for suffix, limit, of in (("bus", 52, naming.bus_name), ("bus-credentials", 253, naming.bus_secret_name)):
        assert child_name(name, suffix, limit) == of(name)
    assert bus_run(exp_obj(name)) == naming.default_bus_run(_model(exp_obj(name))) == "team-a.0123456789ab"
    pinned = exp_obj(name)
    pinned["metadata"]["annotations"] = {naming.BUS_RUN_ANNOTATION: ""}
    assert bus_run(pinned) == naming.bus_run(_model(pinned)) == ""


def _model(obj: dict[str, Any]) -> Any:
    """What kuberl.operator.naming reads of an RLExperiment model: namespace, annotations, the uid (an extra field)."""
    meta = obj["metadata"]
    return SimpleNamespace(namespace=meta["namespace"], metadata=SimpleNamespace(annotations=meta.get("annotations"), model_extra={"uid": meta["uid"]}))


def test_the_bus_of_an_experiment():
    ext = bus_endpoint(exp_obj(external={"url": "nats://nats.nats:4222", "credentialsSecret": {"name": "nats-cred"}}))
    assert (ext.url, ext.service, ext.secret, ext.key) == ("nats://nats.nats:4222", None, "nats-cred", "token")
    ext = bus_endpoint(exp_obj(external={"url": "nats://n:4222", "credentialsSecret": {"name": "c", "key": "tok"}}))
    assert (ext.secret, ext.key) == ("c", "tok")
    assert bus_endpoint(exp_obj(external={"url": "nats://n:4222"})).secret is None
    emb = bus_endpoint(exp_obj(embedded={"storage": "1Gi"}))
    assert (emb.url, emb.service, emb.secret) == (None, "curve-bus", "curve-bus-credentials")


def test_the_port_forward_command_and_the_port_it_reports():
    assert port_forward_command("team-a", "curve-bus") == [
        "kubectl", "port-forward", "--namespace", "team-a", "--address", "127.0.0.1", "service/curve-bus", ":4222"]
    assert port_forward_command("ns", "b", kubeconfig="/k", context="kind-x", kubectl="/usr/bin/kubectl")[:5] == [
        "/usr/bin/kubectl", "--kubeconfig", "/k", "--context", "kind-x"]
    assert forwarded_port("Forwarding from 127.0.0.1:53121 -> 4222\n") == 53121
    assert forwarded_port("Forwarding from [::1]:40001 -> 4222") == 40001
    assert forwarded_port("Handling connection for 53121") is None


# -- `kuberl plot <experiment>`: what it draws and says ------------------------------------------------


def plot_args(tmp_path, target: str = "curve") -> Namespace:
    return Namespace(target=target, output=str(tmp_path / "c.png"), namespace="team-a", kubeconfig="/k", context="ctx")


def test_plot_of_an_experiment_draws_the_rows_from_its_bus(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr("kuberl.runtime.plot_cluster.read_cluster_rows", lambda *a: seen.append(a) or rows(9))
    monkeypatch.chdir(tmp_path)
    assert main(plot_args(tmp_path)) == 0
    assert seen == [("curve", "team-a", "/k", "ctx")]
    assert "9 steps; reward, entropy curves in" in capsys.readouterr().out and (tmp_path / "c.png").stat().st_size > 1000


def test_plot_of_an_experiment_without_steps_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kuberl.runtime.plot_cluster.read_cluster_rows", lambda *a: [])
    monkeypatch.chdir(tmp_path)
    assert main(plot_args(tmp_path)) == 2
    assert "experiment team-a/curve: its metrics stream is empty: no training step yet" in capsys.readouterr().err
    assert issubclass(PlotError, Exception)


def test_the_trainers_workdir_and_its_metrics_jsonl_are_on_the_checkpoint_pvc():
    """metrics.jsonl is written to $KUBERL_WORKDIR: in the trainer pod that is the checkpoint PVC, so the file outlives the pod."""
    import yaml

    from kuberl.api import RLExperiment
    from kuberl.operator.builders.trainer import build_trainer_job

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "e2e_tests" / "manifests" / "quickstart-cpu.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    pod = build_trainer_job(RLExperiment.model_validate(doc))["spec"]["template"]["spec"]
    container = pod["containers"][0]
    workdir = next(e["value"] for e in container["env"] if e["name"] == "KUBERL_WORKDIR")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == workdir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == naming.checkpoint_claim_name(RLExperiment.model_validate(doc))


FAKE_KUBECTL = """#!{python}
import os, sys, time
open("{pidfile}", "w").write(str(os.getpid()))
if "{mode}" == "ok":
    print("Forwarding from 127.0.0.1:45678 -> 4222", flush=True)
    print("Forwarding from [::1]:45678 -> 4222", flush=True)
    time.sleep(60)
print('error: services "curve-bus" not found', file=sys.stderr)
sys.exit(1)
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_port_forward_yields_the_port_kubectl_reports_and_stops_it(tmp_path, mode):
    import sys

    from kuberl.runtime.plot_cluster import ClusterError, port_forward

    exe = tmp_path / "kubectl"
    exe.write_text(FAKE_KUBECTL.format(python=sys.executable, mode=mode, pidfile=tmp_path / "pid"))
    exe.chmod(0o755)
    cmd = port_forward_command("team-a", "curve-bus", kubectl=str(exe))
    if mode == "fail":
        with pytest.raises(ClusterError, match='kubectl port-forward failed: error: services "curve-bus" not found'):
            with port_forward(cmd, timeout=20):
                pass
        return
    import psutil

    with port_forward(cmd, timeout=20) as port:
        assert port == 45678
        kubectl = psutil.Process(int((tmp_path / "pid").read_text()))
        assert kubectl.is_running()
    assert not kubectl.is_running() or kubectl.status() == psutil.STATUS_ZOMBIE  # stopped at the end of the block
