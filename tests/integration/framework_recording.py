"""The framework agents (framework_agents.py), unchanged, with a recorder around the rollout agent's engine and episodes.

Loaded by the rollout agent of tests/integration/test_framework_agents_run.py as `framework_recording:<function>`:
importing it wraps VLLMEngine.generate (every request's prompt ids and what vLLM returned) and
AgentWorkflow.run_episode (every sample an episode produced), appending each as a JSON line under
$KUBERL_TEST_RECORD, so the test can check the trained samples against what the engine generated, token for token.
The agent functions themselves are the framework code, re-exported as they are; `every_framework` deals the episodes
of one run to the three in turn (recording which episode went to which), so one `kuberl run` trains all three.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import os
from pathlib import Path
from typing import Any

from framework_agents import langchain_agent, sdk_chat_agent, sdk_responses_agent

from kuberl.runtime.inference.vllm import VLLMEngine
from kuberl.runtime.rollout.agent_workflow import AgentWorkflow

__all__ = ["every_framework", "langchain_agent", "sdk_chat_agent", "sdk_responses_agent"]

RECORD = Path(os.environ["KUBERL_TEST_RECORD"])


def _append(name: str, row: dict[str, Any]) -> None:
    with open(RECORD / f"{name}-{os.getpid()}.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")


_generate = VLLMEngine.generate


async def _recorded_generate(self: VLLMEngine, req: Any) -> Any:
    res = await _generate(self, req)
    _append("engine", {"prompt": list(req.input_ids), "output": res.output_ids, "logprobs": res.logprobs, "finish": res.finish_reason})
    return res


def record_episodes(workflow: type) -> None:
    """Wrap `workflow.run_episode` so that every sample an episode produces is appended under "samples"."""
    run_episode = workflow.run_episode

    async def recorded(self: Any, engine: Any, item: Any, episode: str) -> Any:
        EPISODE.set(episode)  # the agent function runs inside run_episode, in this task's context
        samples = await run_episode(self, engine, item, episode)
        for s in samples:
            _append("samples", {"episode": episode, **s.model_dump()})
        return samples

    workflow.run_episode = recorded


EPISODE: contextvars.ContextVar[str] = contextvars.ContextVar("episode")
FRAMEWORKS = {"sdk_responses_agent": sdk_responses_agent, "sdk_chat_agent": sdk_chat_agent, "langchain_agent": langchain_agent}
_turn = itertools.cycle(FRAMEWORKS)


async def every_framework(client: Any, item: Any) -> None:
    """The next framework agent in turn, recorded under "frameworks" with the episode it served."""
    name = next(_turn)
    _append("frameworks", {"episode": EPISODE.get(), "framework": name})
    return await FRAMEWORKS[name](client, item)


VLLMEngine.generate = _recorded_generate  # type: ignore[method-assign]
record_episodes(AgentWorkflow)
