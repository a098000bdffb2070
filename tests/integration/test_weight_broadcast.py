"""weightSync.mode broadcast end to end on the real vLLM CPU engine (gloo): parity after a broadcast, tied model included,
and a `kuberl run` with mode broadcast that finishes.

The trainer side is weight_sync.sender.publish_broadcast on a trainer-shaped object holding a real Hugging Face model
(other weights than the engine serves), the agent side the real RolloutAgent (weight_sync.agent_side): it asks the
trainer's store, pauses its engine, the vLLM worker joins the gloo group and reloads bucket by bucket
(vllm_worker.kuberl_receive_weights), the agent resumes. The engine's log-probs must then equal the trainer model's
(abs 2e-3 per token) and differ clearly from the weights it served before. Both membership paths run: a late joiner
served by the resync the trainer's collect loop does, then a usual member waited for when a new version is published.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from kuberl.api.v1alpha1 import RLExperiment
from kuberl.runtime.bus import Bus
from kuberl.runtime.bus.names import KEY_WEIGHTS
from kuberl.runtime.inference.base import GenerateRequest
from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.rollout.agent import RolloutAgent
from kuberl.runtime.trainer.batch import response_logprobs
from kuberl.runtime.trainer.bus_io import TrainerBusIO
from kuberl.runtime.weight_sync.sender import publish_broadcast

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

T = 0.7
TOL = 2e-3  # per token |trainer log-prob - engine log-prob|
PROMPTS = [[5, 40, 41, 42], [9, 17, 33, 8, 60], [12, 13, 14]]
INFO = SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu"))


def experiment(name: str, model_dir: Path) -> RLExperiment:
    return RLExperiment.model_validate({
        "apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": name},
        "spec": {"model": {"path": str(model_dir), "dtype": "float32"}, "dataset": {"builtin": "repeat-digit", "size": 8},
                 "rollout": {"engine": "vllm", "accelerator": {"type": "cpu"}},
                 # 1 MiB buckets: the tiny model goes in several, so a lost or reordered bucket shows
                 "weightSync": {"mode": "broadcast", "bucketMB": 1, "joinTimeoutSeconds": 20, "timeoutSeconds": 60},
                 "training": {"totalSteps": 2}},
    })


async def sample(engine: VLLMEngine, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(3):
            res = await engine.generate(GenerateRequest(prompt, max_new_tokens=10, temperature=T, top_p=1.0, seed=seed + 100 * i + j))
            out.append((prompt, res.output_ids, res.logprobs))
    return out


@torch.no_grad()
def gap(model: torch.nn.Module, samples) -> tuple[float, float]:
    model.eval()
    width = max(len(s[1]) for s in samples)
    prox = response_logprobs(model, [s[0] for s in samples], [s[1] for s in samples], width, temperature=T)
    gaps = [abs(float(prox[i, t]) - s[2][t]) for i, s in enumerate(samples) for t in range(len(s[1]))]
    return max(gaps), sum(gaps) / len(gaps)


async def wait_version(bus: Bus, version: int) -> dict:
    for _ in range(200):
        w = await bus.get_state(KEY_WEIGHTS)
        if w is not None and w["version"] == version:
            return w
        await asyncio.sleep(0.05)
    raise AssertionError(f"weights v{version} never published")


async def test_after_a_broadcast_the_engine_samples_the_trainers_policy(vllm_server, nats_server, experiment_name, tmp_path):
    await check_parity(vllm_server, False, nats_server, experiment_name, tmp_path)


async def test_after_a_broadcast_a_tied_model_samples_the_trainers_policy(vllm_instruct_server, nats_server, experiment_name, tmp_path):
    await check_parity(vllm_instruct_server, True, nats_server, experiment_name, tmp_path)


async def check_parity(server, tied: bool, nats_server, experiment_name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    exp = experiment(experiment_name, server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(server.other_weights, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
    assert bool(model.config.tie_word_embeddings) == tied
    bus = await Bus.connect(nats_server.url, experiment_name)
    engine = VLLMEngine(url=server.url)
    await engine.start()
    trainer = SimpleNamespace(info=INFO, spec=exp.spec, bus=TrainerBusIO(bus), model=model, version=5)
    try:
        await engine.pause()
        await engine.update_weights_from_disk(str(server.model_dir), 0)  # whatever an earlier test loaded: v0
        await engine.resume()
        agent = RolloutAgent(exp, bus, engine, None, [], workdir=tmp_path / "agent", agent_id="bc-agent")

        # 1. The engine asks after the version was published (a late joiner): served by the trainer's resync.
        assert (await publish_broadcast(trainer, new_version=True))["members"] == 0  # nobody asked yet
        w = await bus.get_state(KEY_WEIGHTS)
        assert w["mode"] == "broadcast" and w["path"] is None and w["object"] is None and w["rendezvous"].startswith("127.0.0.1:")
        applying = asyncio.create_task(agent.apply_weights(w))
        for _ in range(400):
            if trainer.weight_sender.pending():
                break
            await asyncio.sleep(0.05)
        stats = await publish_broadcast(trainer, new_version=False)
        await asyncio.wait_for(applying, 120)
        assert stats["members"] == 1 and stats["failed"] is None and stats["buckets"] > 1, stats
        assert engine.version == 5
        results = engine.last_reload
        assert results and all(r["complete"] and r["buckets"] == stats["buckets"] for r in results), results
        if tied:
            assert results[0]["tied_layers"] == 2, results  # the tied head was checked (and re-packed if stale)
        trained = await sample(engine, seed=1)
        worst, mean = gap(model, trained)
        print(f"\nbroadcast parity ({'tied' if tied else 'untied'}): max {worst:.2e}, mean {mean:.2e}")
        assert worst < TOL, f"engine vs trainer log-probs after the broadcast: max {worst}, mean {mean}"
        stale_worst, stale_mean = gap(initial, trained)
        assert stale_mean > 20 * mean and stale_worst > 10 * TOL, f"the broadcast barely changed the engine: {stale_mean}"

        # 2. A new version: the usual member is waited for and served in the same update.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        trainer.version = 6
        publishing = asyncio.create_task(publish_broadcast(trainer, new_version=True))
        w6 = await wait_version(bus, 6)
        await asyncio.wait_for(agent.apply_weights(w6), 120)
        stats6 = await asyncio.wait_for(publishing, 120)
        assert stats6["members"] == 1 and stats6["agents"] == ["bc-agent"] and stats6["failed"] is None, stats6
        assert engine.version == 6
        worst6, mean6 = gap(model, await sample(engine, seed=2))
        assert worst6 < TOL, f"after the second broadcast: max {worst6}, mean {mean6}"
    finally:
        await engine.pause()
        await engine.update_weights_from_disk(str(server.model_dir), 0)
        await engine.resume()
        await engine.close()
        await bus.close()
        if getattr(trainer, "weight_sender", None) is not None:
            trainer.weight_sender.store = None


STEPS = 8


def test_kuberl_run_with_broadcast_finishes(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"]["name"] = "broadcast-run"
    doc["spec"]["training"] = {"totalSteps": STEPS}
    doc["spec"]["weightSync"] = {"mode": "broadcast", "bucketMB": 4}
    manifest = tmp_path / "broadcast.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    logs = workdir / "logs"
    tail = "".join((p.name + ":\n" + p.read_text()[-2000:]) for p in sorted(logs.glob("*.log"))) if logs.is_dir() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + tail
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    assert not (workdir / "weights").exists() or not any((workdir / "weights").iterdir()), "broadcast must not write weight files"
    received = {int(v) for v in re.findall(r"received weights v(\d+) by broadcast", (logs / "rollout-0.log").read_text())}
    assert received >= set(range(1, STEPS + 1)), f"the engine did not receive every version: {sorted(received)}"


# -- faults with broadcast: a restarted engine and a restarted trainer (new store, new session) ------------------------


def _broadcast_manifest(tmp_path: Path, name: str, **more):
    from test_run import quickstart_manifest

    # inFlight abort: the quickstart's keep is refused with broadcast (tests/unit/test_api.py)
    return quickstart_manifest(tmp_path, name, **{"weightSync.mode": "broadcast", "weightSync.bucketMB": 1, "weightSync.inFlight": "abort", **more})


def _received(log: Path) -> list[int]:
    return [int(v) for v in re.findall(r"received weights v(\d+) by broadcast", log.read_text())]


def test_a_restarted_engine_gets_the_current_weights_by_broadcast(tmp_path, nats_server, experiment_name):
    from test_faults import assert_each_group_trained_once, finish, launcher_child, start_run, starts, wait_for
    from test_run import read_metrics

    steps = 8
    manifest = _broadcast_manifest(tmp_path, experiment_name, **{"training.totalSteps": steps})
    workdir = tmp_path / "work"
    run = start_run(manifest, workdir, nats_server.url)
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= 3, 420, "step 3", run)
        version_at_kill = read_metrics(workdir)[-1]["step"]
        launcher_child(run.pid, "vllm.entrypoints.openai.api_server").kill()
        finish(run, workdir)
    finally:
        if run.poll() is None:
            run.kill()
    assert_each_group_trained_once(read_metrics(workdir), steps, yaml.safe_load(manifest.read_text())["spec"]["algorithm"]["batchSize"])
    logs = workdir / "logs"
    assert starts(logs / "engine-0.log") == 2 and starts(logs / "rollout-0.log") == 1
    agent_log = (logs / "rollout-0.log").read_text()
    back = [line for line in agent_log.splitlines() if "engine back after" in line]
    assert back and int(back[0].rsplit("serving v", 1)[1]) >= version_at_kill, back
    after = agent_log.split(back[0])[0].count("received weights")  # receives before the engine came back
    assert len(_received(logs / "rollout-0.log")) > after  # the new engine got its weights by broadcast too
    assert set(_received(logs / "rollout-0.log")) >= {steps}


def test_a_restarted_trainer_serves_the_engines_from_its_new_store(tmp_path, nats_server, experiment_name):
    from test_faults import finish, role_process, start_run, wait_for
    from test_run import read_metrics

    steps, every = 10, 4
    manifest = _broadcast_manifest(tmp_path, experiment_name, **{
        "training.totalSteps": steps, "checkpoint.everySteps": every, "failurePolicy.backoffSeconds": 1})
    workdir = tmp_path / "work"
    run = start_run(manifest, workdir, nats_server.url)
    try:
        wait_for(lambda: len(read_metrics(workdir)) >= every + 1, 420, f"step {every + 1}", run)
        role_process(run.pid, "trainer").kill()
        finish(run, workdir)
    finally:
        if run.poll() is None:
            run.kill()
    assert read_metrics(workdir)[-1]["step"] == steps
    logs = workdir / "logs"
    trainer_log = (logs / "trainer.log").read_text()
    stores = re.findall(r"engines connect to (\S+) ", trainer_log)
    assert len(stores) == 2 and stores[0] != stores[1], stores  # a new store (and session) after the restart
    served_after = trainer_log.split(stores[1])[1]
    assert re.search(r"weight broadcast v\d+: .* to 1 engines", served_after), "the restarted trainer served no engine"
    assert set(_received(logs / "rollout-0.log")) >= {steps}
