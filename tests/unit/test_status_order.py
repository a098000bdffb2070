"""The order of the status rules (status._verdict: the first rule that holds wins) where two of them hold at once."""

from __future__ import annotations

from test_status import NOW, PROGRESS, children, cond, make_experiment

from kuberl.operator.status import ObservedChildren, compute_status

COMPLETE = [{"type": "Complete", "status": "True"}]


def test_suspending_a_finished_experiment_keeps_it_succeeded() -> None:
    exp = make_experiment(suspend=True)
    s = compute_status(exp, children(exp, bus_ready=0, rollout_ready=0, trainer_ready=0, job_conditions=COMPLETE), None, NOW)
    assert s["phase"] == "Succeeded" and cond(s, "Complete") == ("True", "TrainingComplete")


def test_a_trainer_failure_for_good_wins_over_suspend() -> None:
    exp = make_experiment(suspend=True, status={"restarts": 2})  # maxRestarts 2: all used
    failed = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": ""}]
    s = compute_status(exp, children(exp, bus_ready=0, rollout_ready=0, trainer_ready=0, job_conditions=failed),
                       {**PROGRESS, "failed": "OSError: EIO"}, NOW)
    assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "MaxRestartsExceeded")


def test_a_retryable_trainer_failure_while_suspending_stays_suspended() -> None:
    """Restarts left: resuming restarts the trainer from its last checkpoint, as after any exit 1."""
    exp = make_experiment(suspend=True)
    s = compute_status(exp, children(exp, bus_ready=0, rollout_ready=0, trainer_ready=0), {**PROGRESS, "failed": "OSError: EIO"}, NOW)
    assert s["phase"] == "Suspended" and cond(s, "Failed")[0] != "True"


def test_a_trainer_failure_wins_over_done() -> None:
    exp = make_experiment()
    s = compute_status(exp, children(exp), {**PROGRESS, "done": True, "failed": "checkpoint upload failed"}, NOW)
    assert s["phase"] == "Failed" and cond(s, "Failed") == ("True", "TrainerFailed")


def test_a_suspended_experiment_is_suspended_even_with_a_missing_secret() -> None:
    exp = make_experiment(suspend=True, model={"id": "meta/llama", "hubTokenSecret": {"name": "hf"}})
    obs = children(exp, bus_ready=0, rollout_ready=0, trainer_ready=0)
    obs = ObservedChildren(bus=obs.bus, rollout=obs.rollout, trainer=obs.trainer, missing_secrets=frozenset({"hf"}))
    s = compute_status(exp, obs, None, NOW)
    assert s["phase"] == "Suspended" and cond(s, "Suspended") == ("True", "Suspended")
