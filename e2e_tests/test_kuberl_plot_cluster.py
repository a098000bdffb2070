"""`kuberl plot <experiment>` against the cluster under test (the local control plane by default).

An RLExperiment whose `spec.bus.external` points at a nats-server started here (with a token, kept in
a Secret named by `credentialsSecret`) gets every step's metrics row published on its metrics stream,
under the run its uid gives (as the trainer would publish it in a pod); `kuberl plot <name> -n <ns>
--kubeconfig <k>` must read the experiment through the API, the token through the Secret, the whole
stream through the bus, and draw every step. The errors: no such experiment, a bus nobody answers at,
and an experiment whose trainer has not reported a step. (The embedded bus goes through kubectl
port-forward, which KWOK's fake pods cannot serve: tests/unit/test_plot_stream.py checks its command.)
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberl.net import free_port
from kuberl.runtime.bus.metrics import MetricsPublisher, read_rows
from kuberl.runtime.bus.names import BusNames
from kuberl.runtime.bus.server import NatsServer, start_nats_server

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).parent / "manifests" / "quickstart-cpu.yaml"
TOKEN = "plot-e2e-" + uuid.uuid4().hex
STEPS = 30
Cluster = Any  # the `cluster` fixture of e2e_tests/conftest.py (kubectl, json, namespace, kubeconfig)


@pytest.fixture(scope="module")
def bus() -> Iterator[NatsServer]:
    server = start_nats_server(token=TOKEN)
    try:
        yield server
    finally:
        server.stop()


def create_experiment(cluster: Cluster, name: str, url: str, secret: str | None = None) -> dict[str, Any]:
    doc = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["bus"] = {"external": {"url": url, **({"credentialsSecret": {"name": secret}} if secret else {})}}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    return cluster.json("get", "rlexperiment", name)


def create_secret(cluster: Cluster, name: str, token: str) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
              "data": {"token": base64.b64encode(token.encode()).decode()}}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(secret))


def run_of(obj: dict[str, Any]) -> str:
    """The run the operator gives the experiment's bus names (kuberl.operator.naming.bus_run)."""
    meta = obj["metadata"]
    pinned = (meta.get("annotations") or {}).get("kuberl.io/bus-run")
    return pinned if pinned is not None else f"{meta['namespace']}.{meta['uid'].replace('-', '')[:12]}"


async def publish_steps(url: str, names: BusNames, n: int) -> None:
    """What the trainer does: one row per step through MetricsPublisher (step 5 twice, as a restart would)."""
    import nats

    nc = await nats.connect(url, token=TOKEN)
    try:
        bus = type("B", (), {"js": nc.jetstream(), "names": names, "url": url, "chunk_size": nc.max_payload})()
        pub = await MetricsPublisher.start(bus, fresh=True)
        for s in range(1, n + 1):
            pub.publish({"step": s, "reward_mean": s / n, "entropy": 2.0, "staleness_mean": 0.5, "staleness_max": 1, "group_ids": ["g"]})
        pub.publish({"step": 5, "reward_mean": 0.5})
        await pub.close()
        assert len(await read_rows(nc.jetstream(), names)) == n
    finally:
        await nc.close()


def kuberl_plot(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kuberl.cli", "plot", *args, "--namespace", cluster.namespace,
                           "--kubeconfig", cluster.kubeconfig], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)


def delete(cluster: Cluster, *what: str) -> None:
    cluster.kubectl("delete", *what, "--ignore-not-found", "--wait=false", check=False)


def test_kuberl_plot_of_an_experiment_reads_every_step_from_its_bus(cluster: Cluster, bus: NatsServer, tmp_path: Path) -> None:
    name, secret = f"plot-{uuid.uuid4().hex[:6]}", f"plot-bus-{uuid.uuid4().hex[:6]}"
    create_secret(cluster, secret, TOKEN)
    obj = create_experiment(cluster, name, bus.url, secret)
    try:
        asyncio.run(publish_steps(bus.url, BusNames.for_experiment(name, run=run_of(obj)), STEPS))
        out = tmp_path / "curves.png"
        done = kuberl_plot(cluster, name, "-o", str(out))
        assert done.returncode == 0, done.stderr
        assert f"{STEPS} steps; reward, entropy, staleness curves in {out}" in done.stdout
        assert out.read_bytes()[:4] == b"\x89PNG"
        # The wrong token: the Secret is what the command reads (not some default).
        create_secret(cluster, secret, "not-the-token")
        done = kuberl_plot(cluster, name, "-o", str(tmp_path / "x.png"))
        assert done.returncode == 2 and f"cannot reach the bus at {bus.url}" in done.stderr, done.stderr
        assert TOKEN not in done.stderr + done.stdout
    finally:
        delete(cluster, "rlexperiment", name)
        delete(cluster, "secret", secret)


def test_kuberl_plot_says_which_experiment_is_missing(cluster: Cluster, tmp_path: Path) -> None:
    done = kuberl_plot(cluster, "no-such-exp", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 2
    assert f"RLExperiment 'no-such-exp' not found in namespace '{cluster.namespace}'" in done.stderr


def test_kuberl_plot_says_when_the_bus_does_not_answer_or_no_step_was_reported(cluster: Cluster, bus: NatsServer, tmp_path: Path) -> None:
    dead, waiting = f"plot-dead-{uuid.uuid4().hex[:6]}", f"plot-wait-{uuid.uuid4().hex[:6]}"
    secret = f"plot-bus-{uuid.uuid4().hex[:6]}"
    create_secret(cluster, secret, TOKEN)
    create_experiment(cluster, dead, f"nats://127.0.0.1:{free_port('127.0.0.1')}")
    create_experiment(cluster, waiting, bus.url, secret)
    try:
        done = kuberl_plot(cluster, dead, "-o", str(tmp_path / "x.png"))
        assert done.returncode == 2 and "cannot reach the bus at nats://127.0.0.1:" in done.stderr, done.stderr
        done = kuberl_plot(cluster, waiting, "-o", str(tmp_path / "x.png"))
        assert done.returncode == 2 and f"the trainer of '{waiting}' has not reported a step yet" in done.stderr, done.stderr
    finally:
        for name in (dead, waiting):
            delete(cluster, "rlexperiment", name)
        delete(cluster, "secret", secret)
