"""Poison tickets: a ticket whose workflow or reward fails on every delivery becomes a failed group.

The agent side runs against the real bus and engine in tests/integration/test_rollout.py; here the
message, the trainer's accounting and the status field, one rule each.
"""

from __future__ import annotations

import json

import pytest

from kuberl.api import RLExperiment, RLExperimentStatus
from kuberl.api.v1alpha1 import TrainingProgress
from kuberl.operator.status import _progress
from kuberl.runtime.bus import Ticket, TrajectoryGroup
from kuberl.runtime.bus.messages import MessageError, decode_group
from tests.unit.test_trainer_stages import B, group, make_trainer


def failed(tk: Ticket, reason: str = "RewardError: reward 'boom' raised ValueError") -> TrajectoryGroup:
    return TrajectoryGroup(group_id=tk.ticket_id, ticket=tk, rejected=True, failure=reason)


class TestTheMessage:
    def test_a_failed_group_carries_its_reason_over_the_bus(self):
        tk = Ticket(ticket_id="e0-i1-1", index=1, epoch=0, issued_version=0)
        back = decode_group(failed(tk).encode())
        assert back.rejected and back.failure.startswith("RewardError")

    def test_a_failure_without_rejection_is_refused(self):
        tk = Ticket(ticket_id="e0-i1-1", index=1, epoch=0, issued_version=0)
        with pytest.raises(ValueError, match="has a failure but is not rejected"):
            TrajectoryGroup(group_id=tk.ticket_id, ticket=tk, rejected=False, failure="x",
                            samples=group(tk).samples)
        with pytest.raises(MessageError):
            decode_group(json.dumps({"group_id": "a", "ticket": tk.model_dump(), "failure": "x"}).encode())


class TestTheTrainerCountsAndReplacesThem:
    async def test_a_failed_group_is_counted_its_slot_given_back_and_a_new_ticket_issued(self, tmp_path):
        t = make_trainer(tmp_path)
        t.bus.answer = lambda tk: failed(tk) if tk.ticket_id == t.bus.tickets[0].ticket_id else group(tk)
        await t.stage_issue_tickets()
        plan = await t.stage_collect()
        assert len(plan["groups"]) == B and t.bus.tickets[0].ticket_id not in [g["group_id"] for g in plan["groups"]]
        assert t.failed_groups == 1 and t.book.rejected == 1 and t.book.issued == B + 1
        t.bus.groups_buffered = 0
        assert t._progress_base()["failed_groups"] == 1


class TestStatus:
    def exp(self) -> RLExperiment:
        return RLExperiment.model_validate({"apiVersion": "kuberl.io/v1alpha1", "kind": "RLExperiment", "metadata": {"name": "x"},
                                            "spec": {"model": {"builtin": "tiny-qwen2"}, "dataset": {"builtin": "repeat-digit"}}})

    def test_status_progress_shows_failed_groups_and_entropy(self):
        out = _progress(self.exp(), {"step": 3, "policy_version": 3, "dropped_stale": 0, "failed_groups": 2, "entropy": 1.25}, {})
        assert out["failedGroups"] == 2 and out["entropy"] == 1.25
        TrainingProgress.model_validate(out)  # the CRD's schema has the fields
        RLExperimentStatus.model_validate({"progress": out})


class TestARunWhoseEveryGroupFails:
    """An agent whose every call fails (an endpoint the proxy lacks, a reward that always raises) must not leave the
    run at step 0 forever with the reason only in the agents' logs."""

    async def test_it_stops_as_a_configuration_error_naming_the_latest_reason_and_progress_shows_it_first(self, tmp_path):
        from kuberl.runtime.errors import ConfigError

        t = make_trainer(tmp_path)
        t.bus.answer = lambda tk: failed(tk, "AgentError: POST /v1/responses: 404")
        published = t.bus.progress
        await t.stage_issue_tickets()
        with pytest.raises(ConfigError, match=r"the last \d+ trajectory groups all failed .*latest: item \d+: AgentError: POST /v1/responses: 404"):
            await t.stage_collect()
        assert t.failed_in_a_row == t.failed_groups >= t.max_failed_in_a_row
        assert published and published[0]["failed_groups"] >= 1 and "404" in published[0]["last_failure"]

    async def test_a_usable_group_between_failures_resets_the_count(self, tmp_path):
        t = make_trainer(tmp_path)
        n = 0

        def answer(tk):
            nonlocal n
            n += 1
            return group(tk) if n % 5 == 0 else failed(tk)  # four failures, then a good group: 8 failures in all

        t.bus.answer = answer
        await t.stage_issue_tickets()
        plan = await t.stage_collect()
        assert len(plan["groups"]) == B and t.failed_groups >= t.max_failed_in_a_row > t.failed_in_a_row


def test_the_live_line_shows_failed_groups_and_the_latest_reason():
    from kuberl.runtime.launcher import progress_info

    report = {"policy_version": 0, "reward_mean": None, "failed_groups": 3, "last_failure": "item 4: AgentError: 404 Not Found"}
    assert progress_info(report).endswith("| failed groups 3, latest item 4: AgentError: 404 Not Found")
    assert "failed" not in progress_info({"policy_version": 2, "failed_groups": 0})

    def test_status_progress_shows_the_latest_failures_reason_while_the_run_goes_on(self):
        """On a cluster `kubectl get rlx -o yaml` shows why groups fail as they fail, not only once a run has stopped."""
        reason = "item 7: reward function raised ZeroDivisionError: division by zero"
        out = _progress(self.exp(), {"step": 3, "policy_version": 3, "dropped_stale": 0, "failed_groups": 2, "last_failure": reason}, {})
        assert out["lastFailure"] == reason
        RLExperimentStatus.model_validate({"progress": out})  # the status model (and so the CRD's schema) has the field
        assert "lastFailure" not in _progress(self.exp(), {"step": 3, "policy_version": 3, "dropped_stale": 0}, {})
