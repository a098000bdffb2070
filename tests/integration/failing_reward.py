"""A reward that always raises (loaded by the rollout agent as `failing_reward:always_fails` in
tests/integration/test_run_lifetime.py): every episode of the run fails, as a broken reward function makes it."""


def always_fails(prompt: str, completion: str, answer: str) -> float:
    raise RuntimeError("this reward always fails (tests/integration/failing_reward.py)")
