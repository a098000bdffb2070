"""`kuberl run` trains agents that run in their own process, through the episode API (workflow.external).

external_agent.py is that process: it takes episodes from the run's episode API (URL and key from the workdir, as
`kuberl run` prints them) and deals them in turn to the three framework agents of framework_agents.py, unchanged (the
OpenAI Agents SDK with its Responses model and with its Chat Completions model, LangChain's ChatOpenAI), each run
against its episode's base URL and key; it closes each episode for workflow.reward to score. The rollout agent records what vLLM
returned and every trained sample (external_recording.py, loaded as the run's reward): every sample must be the
episode's calls token for token, as for in-pod agents (test_framework_agents_run.py's checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_framework_agents_run import FRAMEWORKS, generated_runs, rows
from tests.integration.test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 2
BATCH = 2  # prompts a step
GROUP = 4  # episodes a prompt
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def external_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("external")
    record = tmp / "record"
    record.mkdir()
    manifest = quickstart_manifest(tmp, "external-agent", **{
        "training.totalSteps": STEPS,
        "algorithm.batchSize": BATCH,
        "algorithm.samplesPerPrompt": GROUP,
        "algorithm.maxNewTokens": 24,  # a concat episode's calls share it: two or three calls of max_tokens 8
        "rollout.concurrency": 2 * BATCH,
        "workflow": {"type": "agent", "external": {"claimTimeoutSeconds": 300}, "exportStyle": "concat", "episodeTimeoutSeconds": 120,
                     "reward": "external_recording:repeat_digit"},
    })
    workdir = tmp / "work"
    episodes = tmp / "episodes.jsonl"
    env = {**os.environ, "KUBERL_TEST_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    agent = subprocess.Popen([sys.executable, str(HERE / "external_agent.py"), str(workdir), ",".join(FRAMEWORKS), str(episodes)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                              cwd=ROOT, capture_output=True, text=True, timeout=840, env=env)
    finally:
        agent.terminate()
        agent_out = agent.communicate(timeout=30)[0]
    return proc, workdir, record, episodes, agent.pid, agent_out


def test_kuberl_run_prints_where_the_episode_api_is(external_run):
    proc, workdir, *_ = external_run
    info = json.loads((workdir / "episode-api.json").read_text())
    assert f"episode API for external agents at {info['urls'][0]}" in proc.stdout
    assert info["urls"][0].startswith("http://127.0.0.1:") and info["key_file"] in proc.stdout
    assert (Path(info["key_file"]).stat().st_mode & 0o077) == 0  # the key file is the user's only


def test_the_external_agent_trains_every_step(external_run):
    proc, workdir, _, episodes, agent_pid, agent_out = external_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + agent_out[-2000:]
    metrics = read_metrics(workdir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert {m["samples"] for m in metrics} == {BATCH * GROUP} and metrics[-1]["failed_groups"] == 0
    closed = [json.loads(line) for line in episodes.read_text().splitlines()]
    assert len(closed) >= STEPS * BATCH * GROUP and {c["pid"] for c in closed} == {agent_pid}, agent_out[-2000:]
    assert all(c["closed"] == 200 and "error" not in c for c in closed), closed


@pytest.mark.parametrize("agent", FRAMEWORKS)
def test_every_episode_is_its_calls_token_for_token(external_run, agent):
    _, _, record, episodes, _, _ = external_run
    served = {}
    for r in rows(record, "engine"):
        served.setdefault(tuple(r["prompt"]), []).append((r["output"], r["logprobs"]))
    closed = [json.loads(line) for line in episodes.read_text().splitlines()]
    mine = {f"{c['group']['id']}/{c['group']['index']}" for c in closed if c["function"] == agent}
    samples = [s for s in rows(record, "samples") if s["episode"] in mine]  # episodes this framework ran and closed
    assert len(samples) >= STEPS * BATCH * GROUP // len(FRAMEWORKS), (agent, len(samples))
    for s in samples:
        full = s["input_ids"] + s["output_ids"]
        runs = generated_runs(s)
        assert len(runs) >= 2 and s["num_turns"] == len(runs), s["episode"]  # the answer and the follow-up, at least
        for a, b in runs:  # each generated run: what vLLM returned for exactly the tokens before it
            assert (s["output_ids"][a:b], s["logprobs"][a:b]) in served[tuple(full[: len(s["input_ids"]) + a])], s["episode"]
        assert runs[-1][1] == len(s["output_ids"])
        assert all(v == -1 for v, m in zip(s["versions"], s["loss_mask"]) if not m)


def test_no_process_of_the_run_survives_it(external_run):
    _, workdir, *_ = external_run
    assert processes_mentioning(str(workdir)) == []
