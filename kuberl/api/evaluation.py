"""`spec.evaluation`: held-out evaluation of the policy every N training steps (and at the end).

The trainer issues one evaluation ticket per held-out item at the current policy version; the rollout
agents run them with spare slots (training tickets first), `samplesPerPrompt` sampled responses and one
greedy response each; the trainer merges the results into the metrics of the step they complete at
(`eval/...` keys in metrics.jsonl and the trackers) and into status.progress.eval. See docs/evaluation.md.

Built on the pieces of kuberl.api.v1alpha1 (which imports this module for RLExperimentSpec.evaluation).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from kuberl.api.base import KubeModel, _cel

EVAL_ONE_SOURCE = "set exactly one of evaluation.split or evaluation.path"
EVAL_K_TOO_BIG = "every evaluation.passAtK value must be at most evaluation.samplesPerPrompt"
EVAL_NOTHING = "evaluation needs samplesPerPrompt >= 1 or greedy true: it would measure nothing"


class EvaluationSpec(KubeModel):
    """Held-out evaluation: a split of spec.dataset or a file, every `everySteps` steps and after the last one."""

    model_config = _cel(
        ("[has(self.split), has(self.path)].filter(x, x).size() == 1", EVAL_ONE_SOURCE),
        ("(has(self.passAtK) ? self.passAtK : [1]).all(k, k <= (has(self.samplesPerPrompt) ? self.samplesPerPrompt : 4))", EVAL_K_TOO_BIG, ".passAtK"),
        ("(has(self.samplesPerPrompt) ? self.samplesPerPrompt : 4) > 0 || !has(self.greedy) || self.greedy", EVAL_NOTHING, ".greedy"),
    )
    split: str | None = Field(
        None, min_length=1, max_length=128,
        description="A split of spec.dataset (dataset.id, or a saved data set folder), e.g. test; for dataset.builtin, "
                    "held-out items generated from the split's name. Must differ from dataset.split.",
    )
    path: str | None = Field(
        None, min_length=1, max_length=4096,
        description="A .jsonl/.json/.parquet file with the same promptField/answerField (inside dataset.volume when set).",
    )
    size: int | None = Field(None, ge=1, le=100_000, description="Evaluate at most this many items (the first ones); builtin: generate this many (default 64).")
    every_steps: int = Field(10, ge=1, le=1_000_000, description="Evaluate after every this many training steps, and after the last one.")
    samples_per_prompt: int = Field(4, ge=0, le=256, description="Sampled responses per item (temperature below); 0 = greedy only.")
    temperature: float | None = Field(None, gt=0.0, le=2.0, description="Sampling temperature of the sampled responses; default algorithm.temperature.")
    greedy: bool = Field(True, description="Also one greedy (temperature 0) response per item: eval/greedy_reward_mean, eval/pass_at_1_greedy.")
    pass_at_k: list[Annotated[int, Field(ge=1, le=256)]] = Field(
        default_factory=lambda: [1], max_length=8,
        description="k values of sampled pass@k (unbiased estimator 1 - C(n-c,k)/C(n,k) over samplesPerPrompt n); each 1 <= k <= samplesPerPrompt.",
    )
    correct_reward: float = Field(
        1.0, description="A response counts as correct (pass@k, pass_at_1_greedy) when its reward is at least this: 1.0 fits 0/1 "
                         "and +-1 rewards; for a reward model's scores, the score that means correct.",
    )

    @model_validator(mode="after")
    def _rules(self) -> EvaluationSpec:
        if (self.split is None) == (self.path is None):
            raise ValueError(EVAL_ONE_SOURCE)
        if any(k > self.samples_per_prompt for k in self.pass_at_k):
            raise ValueError(EVAL_K_TOO_BIG)
        if self.samples_per_prompt == 0 and not self.greedy:
            raise ValueError(EVAL_NOTHING)
        return self


class EvalProgress(KubeModel):
    """The last finished evaluation round, as status.progress.eval shows it."""

    step: int = Field(0, ge=0, description="Training step whose weights were evaluated.")
    policy_version: int = Field(0, ge=0, description="Policy version the evaluation tickets asked for.")
    items: int = Field(0, ge=0, description="Held-out items evaluated.")
    reward_mean: float | None = Field(None, description="Mean reward of the sampled responses.")
    greedy_reward_mean: float | None = Field(None, description="Mean reward of the greedy responses.")
    pass_at_1_greedy: float | None = Field(None, ge=0, le=1, description="Fraction of items whose greedy response is correct.")
    pass_at_k: dict[str, float] = Field(default_factory=dict, description="Sampled pass@k by k (unbiased estimator).")
    updated_at: str | None = Field(None, description="When the round finished.")


def eval_status(value: Any, time_text: Any = lambda t: None) -> dict[str, Any] | None:
    """status.progress.eval (camelCase) from the bus progress key's `eval` object; None when absent or malformed.
    `time_text` turns its `time` (epoch seconds) into the status's timestamp text."""
    if not isinstance(value, dict):
        return None
    try:
        updated_at = time_text(value.get("time"))
        fields = {k: v for k, v in value.items() if k in EvalProgress.model_fields}
        return EvalProgress.model_validate({**fields, "updated_at": updated_at}).to_manifest()
    except ValueError:  # pydantic's ValidationError: an older or foreign writer; status keeps going without it
        return None
