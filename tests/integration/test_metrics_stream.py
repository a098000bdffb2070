"""Every step's metrics row on the bus: a short real `kuberl run` (vLLM CPU engine, agent, trainer) on the
session's nats-server (--bus-url, so the stream outlives the run) must leave one message per step in the
experiment's metrics stream, equal to its metrics.jsonl rows (less group_ids); publishing a step again,
as a restarted trainer would, must not add a message; and `kuberl plot` of the workdir still works.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from kuberl.runtime.bus import Bus
from kuberl.runtime.bus.metrics import MetricsPublisher, read_rows
from kuberl.runtime.bus.names import BusNames

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
STEPS = 6


@pytest.fixture(scope="module")
def bus_run(nats_server, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, str]:
    tmp = tmp_path_factory.mktemp("metrics-stream")
    name = f"stream-{uuid.uuid4().hex[:8]}"
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"]["totalSteps"] = STEPS
    manifest = tmp / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    workdir = tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir), "--bus-url", nats_server.url],
                          cwd=ROOT, capture_output=True, text=True, timeout=840)
    return proc, workdir, name


async def stream_state(url: str, name: str) -> tuple[int, list[dict]]:
    bus = await Bus.connect(url, name, create=False)
    try:
        names = BusNames.for_experiment(name, run="")
        info = await bus.js.stream_info(names.metrics_stream)
        return info.state.messages, await read_rows(bus.js, names)
    finally:
        await bus.close()


async def republish(url: str, name: str, row: dict) -> int:
    bus = await Bus.connect(url, name, create=False)
    try:
        pub = await MetricsPublisher.start(bus, fresh=False)  # a resumed trainer: the stream is kept
        pub.publish(row)
        await pub.close()
        return pub.published
    finally:
        await bus.close()


def test_every_step_of_a_run_is_in_the_stream_exactly_once(bus_run, nats_server):
    proc, workdir, name = bus_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    file_rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in file_rows] == list(range(1, STEPS + 1))
    messages, rows = asyncio.run(stream_state(nats_server.url, name))
    assert messages == STEPS
    assert rows == [{k: v for k, v in r.items() if k != "group_ids"} for r in file_rows]
    assert all(isinstance(r["reward_mean"], float) and "entropy" in r for r in rows)


def test_a_step_published_again_is_not_duplicated(bus_run, nats_server):
    proc, workdir, name = bus_run
    assert proc.returncode == 0
    first = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[2])
    assert asyncio.run(republish(nats_server.url, name, {**first, "reward_mean": -1.0})) == 1  # the server took it...
    messages, rows = asyncio.run(stream_state(nats_server.url, name))
    assert messages == STEPS  # ...and kept the step once: its first row
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and rows[2]["reward_mean"] == first["reward_mean"]


def test_kuberl_plot_of_the_workdir_still_draws_it(bus_run):
    proc, workdir, _ = bus_run
    assert proc.returncode == 0
    done = subprocess.run([sys.executable, "-m", "kuberl.cli", "plot", str(workdir)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{STEPS} steps; reward" in done.stdout and (workdir / "curves.png").exists()
