"""`kuberl run` follows the trainer's progress in the bus KV: a real nats-server, the launcher's own reader.

The supervisor stops the reader as soon as the trainer process exits. The trainer writes its final
report (the last step, the final evaluation round) just before it exits, so the reader can be stopped
between that write and its next read: the final report must still be the one the launcher returns.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime.bus import Bus
from kuberl.runtime.launcher import LocalRun, watch_progress

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def local_run(name: str, url: str, tmp_path: Path) -> LocalRun:
    exp = RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}, "workflow": {"reward": "repeat-digit"},
                 "training": {"totalSteps": 6}},
    })
    return LocalRun(exp, tmp_path / "experiment.yaml", tmp_path, url)


async def put_progress(url: str, name: str, report: dict) -> None:
    bus = await Bus.connect(url, name)
    try:
        await bus.put_state("progress", report)
    finally:
        await bus.close()


def test_the_final_report_written_just_before_the_trainer_exits_is_not_lost(nats_server, experiment_name, tmp_path, capsys):
    final = {"step": 6, "total_steps": 6, "policy_version": 6, "reward_mean": 0.5, "done": True,
             "eval": {"step": 6, "policy_version": 6, "items": 8, "reward_mean": 0.25, "pass_at_k": {"1": 0.25}}}
    asyncio.run(put_progress(nats_server.url, experiment_name, final))

    async def stopped_before_the_first_read():
        stop = asyncio.Event()
        stop.set()  # the supervisor saw the trainer's process exit before the reader's next read
        return await watch_progress(local_run(experiment_name, nats_server.url, tmp_path), stop)

    report = asyncio.run(stopped_before_the_first_read())
    assert report == final
    out = capsys.readouterr().out
    assert "step 6/6" in out and "eval (step 6, v6, 8 items)" in out, out


def test_a_bus_without_progress_returns_none_after_one_bounded_read(nats_server, experiment_name, tmp_path):
    async def stopped():
        stop = asyncio.Event()
        stop.set()
        return await asyncio.wait_for(watch_progress(local_run(experiment_name, nats_server.url, tmp_path), stop), timeout=20)

    assert asyncio.run(stopped()) is None
