"""A recorder in the rollout agent for tests/integration/test_external_agent_run.py, loaded as its workflow.reward.

With workflow.external the rollout agent imports no agent code; the run's reward, `external_recording:repeat_digit`
(the builtin repeat-digit reward, unchanged), is the one import path it loads, so importing this module there wraps
VLLMEngine.generate (every request's prompt ids and what vLLM returned) and ExternalAgentWorkflow.run_episode (every
sample an episode produced), appending each as a JSON line under $KUBERL_TEST_RECORD (framework_recording.py's format).
"""

from __future__ import annotations

from typing import Any

from framework_recording import _append

from kuberl.runtime.rewards import REWARDS
from kuberl.runtime.rollout.episode_api import ExternalAgentWorkflow

__all__ = ["repeat_digit"]

repeat_digit = REWARDS["repeat-digit"]
_run_episode = ExternalAgentWorkflow.run_episode


async def _recorded_episode(self: ExternalAgentWorkflow, engine: Any, item: Any, episode: str) -> Any:
    samples = await _run_episode(self, engine, item, episode)
    for s in samples:
        _append("samples", {"episode": episode, **s.model_dump()})
    return samples


ExternalAgentWorkflow.run_episode = _recorded_episode  # type: ignore[method-assign]
