"""The reward of tests/integration/test_lora_run.py (loaded by the rollout agent as `lora_digit_reward:digit_share`
through workflow.reward's package.module:function form): the share of digits among the first 12 characters.

Unlike repeat-digit's copy task, it asks for no new token mapping, only a shift of the output distribution,
which adapters on the projections of the random tiny model can learn within a test's minutes."""


def digit_share(prompt: str, completion: str, answer: str) -> float:
    return sum(c.isdigit() for c in completion[:12]) / 12
