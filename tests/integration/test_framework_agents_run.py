"""`kuberl run` trains agents written with the OpenAI Agents SDK (its default Responses model, and its
OpenAIChatCompletionsModel) and LangChain's ChatOpenAI, unchanged but for base URL and key, on the builtin tiny model.

One `kuberl run` of 2 steps (`workflow.type: agent`) deals its episodes to the three framework agents
(framework_agents.py) in turn, through framework_recording.py, which records in the rollout agent which framework
served each episode, what vLLM returned for every request and every sample the episodes produced. Every trained sample
must be the episode's calls token for token: each generated run exactly a completion vLLM returned for exactly the
tokens before it (with its log-probs), the sample the concatenation of the last call's prompt and answer. The
translation and the tool rounds carry most assertions in tests/unit/test_responses_api.py and
tests/unit/test_framework_agents.py (the tiny model rarely calls a tool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 2
BATCH = 2  # prompts a step
GROUP = 4  # episodes a prompt
HERE = Path(__file__).parent


FRAMEWORKS = ["sdk_responses_agent", "sdk_chat_agent", "langchain_agent"]


@pytest.fixture(scope="module")
def framework_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("frameworks")
    record = tmp / "record"
    record.mkdir()
    manifest = quickstart_manifest(tmp, "framework-agents", **{
        "training.totalSteps": STEPS,
        "algorithm.batchSize": BATCH,
        "algorithm.samplesPerPrompt": GROUP,
        "algorithm.maxNewTokens": 24,  # a concat episode's calls share it: two or three calls of max_tokens 8
        "rollout.concurrency": 2 * BATCH,
        "workflow": {"type": "agent", "agent": "framework_recording:every_framework", "exportStyle": "concat", "episodeTimeoutSeconds": 120,
                     "reward": "repeat-digit"},
    })
    workdir = tmp / "work"
    env = {**os.environ, "KUBERL_TEST_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=840, env=env)
    return proc, workdir, record


def rows(record: Path, name: str) -> list[dict]:
    return [json.loads(line) for path in sorted(record.glob(f"{name}-*.jsonl")) for line in path.read_text().splitlines()]


def generated_runs(sample: dict) -> list[tuple[int, int]]:
    """(start, end) of each run of trained (mask 1) tokens in the sample's output."""
    runs, start = [], None
    for i, m in enumerate([*sample["loss_mask"], 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_the_framework_agents_train_every_step(framework_run):
    proc, workdir, _ = framework_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(workdir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert {m["samples"] for m in metrics} == {BATCH * GROUP} and metrics[-1]["failed_groups"] == 0


@pytest.mark.parametrize("agent", FRAMEWORKS)
def test_every_episode_is_its_calls_token_for_token(framework_run, agent):
    _, _, record = framework_run
    served = {}
    for r in rows(record, "engine"):
        served.setdefault(tuple(r["prompt"]), []).append((r["output"], r["logprobs"]))
    episodes = {r["episode"] for r in rows(record, "frameworks") if r["framework"] == agent}
    samples = [s for s in rows(record, "samples") if s["episode"] in episodes]
    # the episodes are dealt in turn: each framework gets a third of the trained ones at least (less one)
    assert len(samples) >= STEPS * BATCH * GROUP // len(FRAMEWORKS), (agent, len(samples))
    for s in samples:
        full = s["input_ids"] + s["output_ids"]
        runs = generated_runs(s)
        assert len(runs) >= 2 and s["num_turns"] == len(runs), (agent, s["episode"])  # the answer and the follow-up, at least
        for a, b in runs:  # each generated run: what vLLM returned for exactly the tokens before it
            assert (s["output_ids"][a:b], s["logprobs"][a:b]) in served[tuple(full[: len(s["input_ids"]) + a])], (agent, s["episode"])
        assert runs[-1][1] == len(s["output_ids"])  # so the sample is the last call's prompt and its answer
        assert all(v == -1 for v, m in zip(s["versions"], s["loss_mask"]) if not m)


def test_no_process_of_the_run_survives_it(framework_run):
    _, workdir, _ = framework_run
    assert processes_mentioning(str(workdir)) == []
