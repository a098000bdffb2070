"""Rollout workflows (AReaL's RolloutWorkflow): one data set item -> the samples of one trajectory group.

The rollout agent calls `workflow.arun_episode(engine, item, ctx)`; it returns the group's Samples or
None to reject the item. Partial rollouts: a generation cut short by a weight update (finish_reason
abort) continues from prompt + tokens so far once the engine resumes, and every token keeps the
version of the weights that produced it (`PartialGeneration`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from kuberl.api.v1alpha1 import RLExperimentSpec
from kuberl.runtime.bus.messages import Sample
from kuberl.runtime.data import Item
from kuberl.runtime.inference.base import (
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
)
from kuberl.runtime.reward_pool import RewardPool, pool_for
from kuberl.runtime.rewards import RewardFn, RewardRefused

log = logging.getLogger(__name__)

MAX_CONTINUATIONS = 1000  # aborts one generation may survive (each is one weight update)
DEFAULT_FEEDBACK = "Your answer is not correct. Try again."


@dataclass
class SamplingConfig:
    """How each response is sampled (from spec.algorithm)."""

    n: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)  # stop_tokens.StopSet.ids: the model's ends of answer + the manifest's
    stop: list[str] = field(default_factory=list)  # algorithm.stop: strings that end a response (kept in it)
    max_total_tokens: int | None = None  # prompt + response limit (the engine's context)


@dataclass
class EpisodeContext:
    """Per-episode facts the agent passes in: the ticket's id, and a base seed (None = unseeded)."""

    ticket_id: str = ""
    seed: int | None = None


class RolloutWorkflow(Protocol):
    async def arun_episode(self, engine: InferenceEngine, item: Item, ctx: EpisodeContext) -> list[Sample] | None: ...


# ---------------------------------------------------------------------------------------------
# Partial rollouts: continuation bookkeeping (pure)
# ---------------------------------------------------------------------------------------------


class PartialGeneration:
    """Tokens of one response as it is generated in one or more pieces.

    A piece that ends with finish_reason abort (a weight update paused the engine) leaves the response
    unfinished: `next_request()` asks for the rest from prompt + tokens so far, with the remaining budget.
    Each token is stamped with the version that produced it (the engine's per-token versions, else its piece's).
    """

    def __init__(self, prompt_ids: list[int], base: GenerateRequest) -> None:
        self.prompt_ids = list(prompt_ids)
        self.base = base
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None
        self.pieces = 0

    @property
    def remaining(self) -> int:
        return self.base.max_new_tokens - len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def next_request(self) -> GenerateRequest:
        if self.done:
            raise RuntimeError("generation already finished")
        seed = None if self.base.seed is None else self.base.seed + self.pieces
        return GenerateRequest(
            input_ids=self.prompt_ids + self.output_ids, max_new_tokens=self.remaining,
            temperature=self.base.temperature, top_p=self.base.top_p,
            stop_token_ids=list(self.base.stop_token_ids), stop=list(self.base.stop), seed=seed,
        )

    def add(self, res: GenerateResult) -> None:
        if len(res.output_ids) > self.remaining:
            raise ValueError(f"engine returned {len(res.output_ids)} tokens, more than the {self.remaining} asked for")
        self.pieces += 1
        self.output_ids += res.output_ids
        self.logprobs += res.logprobs
        self.versions += res.token_versions()
        if res.finish_reason != "abort":
            self.finish_reason = res.finish_reason
        elif self.remaining <= 0:
            self.finish_reason = "length"


async def generate_continuing(engine: InferenceEngine, prompt_ids: list[int], req: GenerateRequest) -> PartialGeneration:
    """Generate one response, continuing after each abort until it stops or reaches max_new_tokens."""
    return await continue_generation(engine, PartialGeneration(prompt_ids, req))


async def generate_group(engine: InferenceEngine, prompt_ids: list[int], req: GenerateRequest, n: int) -> list[PartialGeneration]:
    """n unseeded responses to one prompt, each continued alone after an abort.

    The first pieces go as one n-sample request where the engine takes one (`generate_n`: the server
    prefills the shared prompt once and parses one request, not n), else as n requests.
    """
    many = getattr(engine, "generate_n", None)
    firsts = await many(req, n) if many is not None else await asyncio.gather(*(engine.generate(req) for _ in range(n)))
    gens = []
    for first in firsts:
        gen = PartialGeneration(prompt_ids, req)
        gen.add(first)
        gens.append(gen)
    return list(await asyncio.gather(*(continue_generation(engine, g) for g in gens)))


async def continue_generation(engine: InferenceEngine, gen: PartialGeneration) -> PartialGeneration:
    """Generate the rest of `gen` piece by piece until it stops or reaches its max_new_tokens."""
    while not gen.done:
        if gen.pieces > MAX_CONTINUATIONS:
            raise RuntimeError(f"generation aborted {gen.pieces} times; giving up")
        gen.add(await engine.generate(gen.next_request()))
    return gen


# ---------------------------------------------------------------------------------------------
# Workflows
# ---------------------------------------------------------------------------------------------


class PromptError(ValueError):
    """Prompts cannot be built as configured (no chat template, a template that refuses the system role)."""


def prompt_text(tokenizer: Any, prompt: str, use_chat_template: bool, system: str | None = None) -> str:
    """The text a prompt is tokenized from. `prompt` is the user message (dataset.prompt's instruction or template
    already applied by data.load_items); with the chat template it follows `system`, else it is used as it is."""
    if not use_chat_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_prompts(tokenizer: Any, use_chat_template: bool, system: str | None) -> None:
    """Refuse at start-up, not per episode, prompts that cannot be built: the chat template missing or refusing."""
    if system and not use_chat_template:
        raise PromptError("dataset.prompt.system needs workflow.useChatTemplate true (raw prompts have no system role)")
    if not use_chat_template:
        return
    if getattr(tokenizer, "chat_template", "") is None:
        raise PromptError("workflow.useChatTemplate is true but the model's tokenizer has no chat template (a base model?): set "
                          "workflow.useChatTemplate false and give the prompt format with dataset.prompt.template")
    try:
        prompt_text(tokenizer, "1 + 1?", True, system)
    except Exception as exc:  # noqa: BLE001  the model's Jinja template: its own words say why
        raise PromptError(f"the tokenizer's chat template cannot build a prompt{' with a system message' if system else ''}: "
                          f"{type(exc).__name__}: {exc}") from exc


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _default_pool(reward_fn: RewardFn, name: str) -> RewardPool:
    """The pool of a workflow built without one: workflow.rewardWorkers and rewardTimeoutSeconds at their defaults."""
    from kuberl.api.v1alpha1 import WorkflowSpec

    fields = WorkflowSpec.model_fields
    return pool_for(reward_fn, name=name, workers=fields["reward_workers"].default, timeout_seconds=fields["reward_timeout_seconds"].default)


class RLVRWorkflow:
    """Single turn: chat-templated prompt -> n sampled responses -> verifiable reward each (scored in `scorer`'s pool)."""

    def __init__(self, tokenizer: Any, reward_fn: RewardFn, sampling: SamplingConfig, *, use_chat_template: bool = True,
                 reward_name: str = "reward", system: str | None = None, scorer: RewardPool | None = None) -> None:
        check_prompts(tokenizer, use_chat_template, system)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.reward_name = reward_name
        self.sampling = sampling
        self.use_chat_template = use_chat_template
        self.system = system
        self.scorer = scorer or _default_pool(reward_fn, reward_name)

    def _request(self, prompt_ids: list[int], max_new: int, seed: int | None) -> GenerateRequest:
        s = self.sampling
        if s.max_total_tokens is not None:
            max_new = min(max_new, s.max_total_tokens - len(prompt_ids))
        if max_new < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under the engine's {s.max_total_tokens}-token context")
        return GenerateRequest(input_ids=prompt_ids, max_new_tokens=max_new, temperature=s.temperature, top_p=s.top_p,
                               stop_token_ids=list(s.stop_token_ids), stop=list(s.stop), seed=seed)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _one(self, engine: InferenceEngine, item: Item, prompt_ids: list[int], seed: int | None) -> Sample:
        gen = await generate_continuing(engine, prompt_ids, self._request(prompt_ids, self.sampling.max_new_tokens, seed))
        return await self._sample(item, prompt_ids, gen)

    async def _score(self, item: Item, output_ids: list[int]) -> float:
        """The response's reward from the pool (0 on timeout, counted there); RewardRefused for NaN/inf."""
        return await self.scorer.score(item.prompt, self._text(output_ids), item.answer, where=f"item {item.index}")

    async def _sample(self, item: Item, prompt_ids: list[int], gen: PartialGeneration) -> Sample:
        reward = await self._score(item, gen.output_ids)
        return Sample(input_ids=prompt_ids, output_ids=gen.output_ids, logprobs=gen.logprobs, versions=gen.versions,
                      loss_mask=[1] * len(gen.output_ids), reward=reward, num_turns=1, finish_reason=gen.finish_reason or "stop")

    # One n-sample request per episode (generate_group) rather than n: single-turn, unseeded episodes only.
    group_requests = True

    def prompt_ids(self, item: Item) -> list[int]:
        """The prompt's tokens: the item's user message, the system message and the chat template as configured."""
        return _encode(self.tokenizer, prompt_text(self.tokenizer, item.prompt, self.use_chat_template, self.system))

    async def arun_episode(self, engine: InferenceEngine, item: Item, ctx: EpisodeContext) -> list[Sample] | None:
        """The group's samples; None (the group rejected, the reason logged) when a reward is not a finite number."""
        try:
            return await self._episode(engine, item, ctx)
        except RewardRefused as exc:
            log.warning("ticket %s, item %d: group rejected: %s", ctx.ticket_id or "-", item.index, exc)
            return None

    async def _episode(self, engine: InferenceEngine, item: Item, ctx: EpisodeContext) -> list[Sample]:
        prompt_ids = self.prompt_ids(item)
        if ctx.seed is None and self.group_requests and self.sampling.n > 1:
            req = self._request(prompt_ids, self.sampling.max_new_tokens, None)
            gens = await generate_group(engine, prompt_ids, req, self.sampling.n)
            return list(await asyncio.gather(*(self._sample(item, prompt_ids, g) for g in gens)))
        seeds = [None if ctx.seed is None else ctx.seed * 1000 + i * 17 for i in range(self.sampling.n)]
        return list(await asyncio.gather(*(self._one(engine, item, prompt_ids, s) for s in seeds)))


class MultiTurnWorkflow(RLVRWorkflow):
    """Retry with feedback until correct (reward 1) or max_turns; reward *= turn_discount per extra turn.

    The feedback turn's tokens are part of output_ids with loss_mask 0 and version -1 (not generated).
    maxNewTokens is the budget of generated tokens of the whole episode: each turn gets what the earlier
    turns left, so the generated length the trainer measures (loss tokens, for DAPO's overlong penalty
    and Dr.GRPO's constant normaliser sequences * maxNewTokens) never exceeds maxNewTokens.
    """

    def __init__(self, tokenizer: Any, reward_fn: RewardFn, sampling: SamplingConfig, *, max_turns: int,
                 turn_discount: float, use_chat_template: bool = True, feedback: str = DEFAULT_FEEDBACK,
                 reward_name: str = "reward", system: str | None = None, scorer: RewardPool | None = None) -> None:
        super().__init__(tokenizer, reward_fn, sampling, use_chat_template=use_chat_template, reward_name=reward_name,
                         system=system, scorer=scorer)
        self.group_requests = False  # each sample's turns depend on its own earlier answers
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback

    def feedback_ids(self, ended_with_eos: bool, stop_text: str | None = None) -> list[int]:
        """Tokens that close the assistant turn (unless its stop token already did) and add the user's feedback.

        `stop_text`: the text of the stop token the turn ended with (default the tokenizer's eos); the template's
        closing is not repeated when it starts with it (a base model's turn that ended at <|im_end|>, not its eos)."""
        if not self.use_chat_template:
            return _encode(self.tokenizer, f"\n{self.feedback}\n")
        marker = "\x00ANSWER\x00"
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
        before = self.tokenizer.apply_chat_template(msgs, tokenize=False)
        after = self.tokenizer.apply_chat_template(msgs + [{"role": "user", "content": self.feedback}], tokenize=False,
                                                   add_generation_prompt=True)
        suffix = after[before.index(marker) + len(marker):]
        eos = (stop_text if stop_text is not None else self.tokenizer.eos_token) or ""
        if ended_with_eos and eos and suffix.startswith(eos):
            suffix = suffix[len(eos):]
        return _encode(self.tokenizer, suffix)

    async def _one(self, engine: InferenceEngine, item: Item, prompt_ids: list[int], seed: int | None) -> Sample:
        out: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        mask: list[int] = []
        reward, turns, finish = 0.0, 1, "stop"  # turns that were generated (at least the first)
        eos_ids = set(self.sampling.stop_token_ids) | {self.tokenizer.eos_token_id}  # every id that ends a turn
        for turn in range(1, self.max_turns + 1):
            context = prompt_ids + out
            left = self.sampling.max_new_tokens - sum(mask)  # the episode's budget, shared by its turns
            try:
                req = self._request(context, left, None if seed is None else seed + turn)
            except ValueError:
                break  # no room left for another turn: keep what we have
            turns = turn
            gen = await generate_continuing(engine, context, req)
            out += gen.output_ids
            lps += gen.logprobs
            vers += gen.versions
            mask += [1] * len(gen.output_ids)
            finish = gen.finish_reason or "stop"
            reward = await self._score(item, gen.output_ids)
            if reward >= 1.0 or turn == self.max_turns or sum(mask) >= self.sampling.max_new_tokens:
                break  # correct, out of turns, or out of budget (no feedback for a turn that cannot come)
            ended = bool(gen.output_ids) and gen.output_ids[-1] in eos_ids
            fb = self.feedback_ids(ended, self.tokenizer.decode(gen.output_ids[-1:]) if ended else None)
            out += fb
            lps += [0.0] * len(fb)
            vers += [-1] * len(fb)
            mask += [0] * len(fb)
        return Sample(input_ids=prompt_ids, output_ids=out, logprobs=lps, versions=vers, loss_mask=mask,
                      reward=reward * self.turn_discount ** (turns - 1), num_turns=turns, finish_reason=finish)


def make_workflow(spec: RLExperimentSpec, tokenizer: Any, *, max_total_tokens: int | None = None) -> RolloutWorkflow:
    """The workflow spec.workflow asks for (registry.WORKFLOWS), with sampling settings from spec.algorithm and the
    model's stop set (stop_tokens.stop_set_for: the folder the tokenizer was loaded from)."""
    from kuberl.runtime.rollout.registry import build_workflow  # lazy: the registry imports this module's classes
    from kuberl.runtime.stop_tokens import stop_set_for

    a = spec.algorithm
    stops = stop_set_for(spec, tokenizer)
    sampling = SamplingConfig(n=a.samples_per_prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                              top_p=a.top_p, stop_token_ids=stops.ids, stop=list(stops.strings), max_total_tokens=max_total_tokens)
    return build_workflow(spec, tokenizer, sampling)
