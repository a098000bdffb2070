"""`kuberl run` with `workflow.type: agent`: an OpenAI-client agent with tool calls learns on the tiny model,
exported one sample per call (exportStyle individual), and bad episodes never stop the run.

The agent is runtime/kuberl/runtime/agents/repeat_tools.py (it passes tools=[check]: a draft, the `check` tool's
result fed back as a role "tool" message, the final answer; only the final answer is scored) wrapped so
that some items misbehave: the agent raises,
hangs past workflow.episodeTimeoutSeconds, or returns a string. Those tickets fail (retried up to
rollout.maxTicketAttempts, then published as failed groups with their reasons); the run finishes every
step and the reward rises.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.test_run import ROOT, processes_mentioning, quickstart_manifest, read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

# ~2.3 s a step here (8 prompts x 8 episodes x 2 calls: each call is a sample, 128 a step), 2.8 min in all, against 5 min at the
# quickstart's 16 prompts; the first call's prompt carries the tool list (~200 tokens of the tiny tokenizer).
# lr 3e-3 rather than the example's 1e-3: at 1e-3 the concat rise over 80 steps varied from +0.09 to +0.19 between runs.
STEPS = 50
LEARNING_RATE = 3e-3
BATCH = 8  # prompts per step (the quickstart's 16 halved: half the time a step; the rise, test_the_agents_reward_rises)
AGENT_MODULE = "kuberl_test_flaky_agent"
AGENT_SOURCE = '''
import asyncio

from kuberl.runtime.agents.repeat_tools import tool_agent


async def flaky_agent(client, item):
    """tool_agent, except on a few items: raise, hang, or return a string."""
    kind = item.index % 40
    if kind == 3:
        raise RuntimeError(f"agent bug on item {item.index}")
    if kind == 7:
        await asyncio.sleep(3600)
    if kind == 11:
        await tool_agent(client, item)
        return "bad"
    return await tool_agent(client, item)
'''


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("agent-run")
    (tmp / f"{AGENT_MODULE}.py").write_text(textwrap.dedent(AGENT_SOURCE))
    manifest = quickstart_manifest(tmp, "agent-learns", **{
        "training.totalSteps": STEPS,
        "algorithm.learningRate": LEARNING_RATE,
        "algorithm.batchSize": BATCH,
        "workflow": {"type": "agent", "agent": f"{AGENT_MODULE}:flaky_agent", "exportStyle": "individual", "episodeTimeoutSeconds": 5,
                     "reward": "repeat-digit"},
    })
    workdir = tmp / "work"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "kuberl.cli", "run", str(manifest), "--workdir", str(workdir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1700, env=env)
    return proc, workdir


def test_the_agent_run_finishes_every_step(agent_run):
    proc, workdir = agent_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(workdir)] == list(range(1, STEPS + 1))


def test_every_call_is_trained_as_a_sample_of_its_own(agent_run):
    _, workdir = agent_run
    # batchSize groups x samplesPerPrompt episodes x 2 calls (ragged groups: tests/integration/test_agent.py)
    assert {m["samples"] for m in read_metrics(workdir)} == {BATCH * 8 * 2}


def test_the_agents_reward_rises(agent_run):
    _, workdir = agent_run
    rewards = [m["reward_mean"] for m in read_metrics(workdir)]
    # Measured here (tool agent, individual, 8 prompts a step), two runs: 0.0035 and 0.0037 over steps 1-10; the best 10-step
    # mean after that 0.10 and 0.08, the last 10 steps 0.103 and 0.043 (the reward of so small a model swings once it rises;
    # 16 prompts a step swung as much: 0.083, 0.105 and 0.063 over the last 10). With learningRate 1e-12 (0 in effect) the
    # reward stays at the random model's level (0.002 -> 0.002): this fails. The bars: the best 10-step mean ten times the
    # start (+0.03), and the last 10 steps still clearly above it (+0.015).
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    best = max(sum(rewards[i - 10:i]) / 10 for i in range(20, len(rewards) + 1))
    assert first < 0.05 and best > first + 0.03 and last > first + 0.015, \
        f"mean reward went from {first:.3f} (steps 1-10) to a best of {best:.3f} and {last:.3f} (last 10)"


def test_failing_episodes_are_failed_groups_with_their_reasons_and_free_their_slots(agent_run):
    _, workdir = agent_run
    assert read_metrics(workdir)[-1]["failed_groups"] >= 1
    log = (workdir / "logs" / "rollout-0.log").read_text()
    assert "the agent raised RuntimeError: agent bug on item" in log
    assert "the agent ran past workflow.episodeTimeoutSeconds (5 s)" in log
    assert "the agent returned 'bad' (str); expected a finite number (the reward) or None" in log
    assert "giving up on it" in log  # the poison-ticket rule published them as failed groups


def test_no_process_of_the_agent_run_survives_it(agent_run):
    _, workdir = agent_run
    assert processes_mentioning(str(workdir)) == []
