"""The workflow interface a researcher implements, and the registry `workflow.type` picks from.

A workflow turns one data set item into the samples of one trajectory group; the rollout agent calls
it once per ticket. `make_workflow` (workflows.py) builds every type through `WORKFLOWS`; `custom`
imports the user's class named by `workflow.class`. See docs/agents.md for a one-file example.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kuberl.api.v1alpha1 import RLExperimentSpec
from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import InferenceEngine
from kuberl.runtime.reward_pool import RewardPool, pool_for
from kuberl.runtime.rewards import RewardFn, resolve_reward


class WorkflowError(ValueError):
    """workflow.class / workflow.agent names nothing usable (a configuration error: the agent exits 2)."""


class EpisodeTimeout(RuntimeError):
    """A custom workflow's episode ran past workflow.episodeTimeoutSeconds (the ticket fails; the run goes on)."""


@runtime_checkable
class RolloutWorkflow(Protocol):
    """What `workflow.type: custom` asks of `workflow.class` (AReaL's RolloutWorkflow).

    `arun_episode(engine, item, ctx)` runs one episode group for one data set item and returns its
    samples (exactly algorithm.samplesPerPrompt of them: the trainer trains groups of that size), or
    None to reject the item (its slot goes back to the trainer, nothing is trained). Generate through
    `engine.generate(GenerateRequest)` or, to survive weight updates mid-generation,
    `kuberl.runtime.rollout.workflows.generate_continuing(engine, prompt_ids, request)`: every
    Sample token carries the version (`versions`) and behaviour logprob the engine reported; tokens the
    policy did not generate (tool outputs, user turns) get loss_mask 0 and version -1.
    An exception gives the ticket back for another try; a workflow that wants its item dropped returns None.
    """

    async def arun_episode(self, engine: InferenceEngine, item: Item, ctx: Any) -> list[Sample] | None: ...


@dataclass
class WorkflowSetup:
    """What a workflow class may take in its constructor: `Class(setup)` (or `Class()` if it takes nothing)."""

    spec: RLExperimentSpec
    tokenizer: Any
    sampling: Any  # workflows.SamplingConfig: n, max_new_tokens, temperature, top_p, stop_token_ids, max_total_tokens
    reward_fn: RewardFn
    # `await scorer.score(prompt, completion, answer)`: reward_fn in worker processes, workflow.rewardTimeoutSeconds each
    scorer: RewardPool | None = None


def import_path(path: str, what: str) -> Any:
    """The object named by `package.module:attr` (`what` names the manifest field in errors)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise WorkflowError(f"{what}: {path!r} is not of the form package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkflowError(f"{what}: cannot import module {module_name!r} of {path!r} (is it in the runtime image or "
                            f"rollout.image?): {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise WorkflowError(f"{what}: module {module_name!r} has no attribute {attr!r}")
    return obj


def _rlvr(setup: WorkflowSetup) -> RolloutWorkflow:
    from kuberl.runtime.rollout.workflows import RLVRWorkflow

    w, prompt = setup.spec.workflow, setup.spec.dataset.prompt
    return RLVRWorkflow(setup.tokenizer, setup.reward_fn, setup.sampling, use_chat_template=w.use_chat_template, reward_name=w.reward,
                        system=prompt.system if prompt else None, scorer=setup.scorer)


def _multi_turn(setup: WorkflowSetup) -> RolloutWorkflow:
    from kuberl.runtime.rollout.workflows import MultiTurnWorkflow

    w, prompt = setup.spec.workflow, setup.spec.dataset.prompt
    return MultiTurnWorkflow(setup.tokenizer, setup.reward_fn, setup.sampling, max_turns=w.max_turns, turn_discount=w.turn_discount,
                             use_chat_template=w.use_chat_template, reward_name=w.reward, system=prompt.system if prompt else None,
                             scorer=setup.scorer)


def _agent(setup: WorkflowSetup) -> RolloutWorkflow:
    """workflow.agent: the in-pod function; workflow.external: agents in their own processes, through the episode API."""
    if setup.spec.workflow.external is not None:
        from kuberl.runtime.rollout.episode_api import ExternalAgentWorkflow

        return ExternalAgentWorkflow.from_setup(setup)
    from kuberl.runtime.rollout.agent_workflow import AgentWorkflow

    return AgentWorkflow.from_setup(setup)


class TimedWorkflow:
    """A custom workflow whose episodes are cancelled past workflow.episodeTimeoutSeconds; `inner` is the user's object."""

    def __init__(self, inner: RolloutWorkflow, timeout_seconds: float) -> None:
        self.inner = inner
        self.timeout = timeout_seconds

    async def arun_episode(self, engine: InferenceEngine, item: Item, ctx: Any) -> list[Sample] | None:
        try:
            return await asyncio.wait_for(self.inner.arun_episode(engine, item, ctx), self.timeout)
        except TimeoutError:
            raise EpisodeTimeout(f"workflow.class episode ran past workflow.episodeTimeoutSeconds ({self.timeout:g} s)") from None


def _custom(setup: WorkflowSetup) -> RolloutWorkflow:
    path = setup.spec.workflow.workflow_class or ""
    cls = import_path(path, "workflow.class")
    if not inspect.isclass(cls):
        raise WorkflowError(f"workflow.class: {path!r} is a {type(cls).__name__}, not a class")
    if not inspect.iscoroutinefunction(getattr(cls, "arun_episode", None)):
        raise WorkflowError(f"workflow.class: {path!r} has no `async def arun_episode(self, engine, item, ctx)`")
    takes = [p for p in inspect.signature(cls).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    try:
        inner = cls(setup) if takes else cls()
    except Exception as exc:  # noqa: BLE001  the user's constructor: name it in the configuration error
        raise WorkflowError(f"workflow.class: constructing {path} failed: {type(exc).__name__}: {exc}") from exc
    return TimedWorkflow(inner, setup.spec.workflow.episode_timeout_seconds)


# workflow.type -> factory(setup). Add a built-in workflow: one module plus one line here.
WORKFLOWS: dict[str, Callable[[WorkflowSetup], RolloutWorkflow]] = {
    "rlvr": _rlvr,
    "multi-turn": _multi_turn,
    "agent": _agent,
    "custom": _custom,
}


def build_workflow(spec: RLExperimentSpec, tokenizer: Any, sampling: Any) -> RolloutWorkflow:
    """The workflow spec.workflow.type names, set up with the tokenizer and sampling settings."""
    kind = str(spec.workflow.type)
    if kind not in WORKFLOWS:
        raise WorkflowError(f"workflow.type: unknown workflow {kind!r} (known: {', '.join(sorted(WORKFLOWS))})")
    w = spec.workflow
    reward_fn = resolve_reward(w.reward)
    scorer = pool_for(reward_fn, name=w.reward, workers=w.reward_workers, timeout_seconds=w.reward_timeout_seconds)
    setup = WorkflowSetup(spec=spec, tokenizer=tokenizer, sampling=sampling, reward_fn=reward_fn, scorer=scorer)
    return WORKFLOWS[kind](setup)
