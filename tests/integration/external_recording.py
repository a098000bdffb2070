"""A recorder in the rollout agent for tests/integration/test_external_agent_run.py, loaded as its workflow.reward.

With workflow.external the rollout agent imports no agent code; the run's reward, `external_recording:repeat_digit`
(the builtin repeat-digit reward, unchanged), is the one import path it loads, so importing this module there wraps
VLLMEngine.generate (every request's prompt ids and what vLLM returned) and ExternalAgentWorkflow.run_episode (every
sample an episode produced), appending each as a JSON line under $KUBERL_TEST_RECORD (framework_recording.py's format).
"""

from __future__ import annotations

from framework_recording import record_episodes

from kuberl.runtime.rewards import REWARDS
from kuberl.runtime.rollout.episode_api import ExternalAgentWorkflow

__all__ = ["repeat_digit"]

repeat_digit = REWARDS["repeat-digit"]
record_episodes(ExternalAgentWorkflow)
