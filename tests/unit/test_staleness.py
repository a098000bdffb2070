"""The staleness bound and the ticket issuer, one class per rule (AReaL's test layout)."""

from __future__ import annotations

import pytest

from kuberl.runtime.staleness import StalenessManager, TicketIssuer, ticket_id


def manager(B: int = 4, eta: int = 0, cap: int | None = None, **counters: int) -> StalenessManager:
    return StalenessManager(batch_size=B, max_head_offpolicyness=eta, max_concurrent=cap, **counters)


class TestSynchronousWhenEtaIsZero:
    def test_at_version_zero_exactly_one_batch_may_start(self):
        assert manager(B=4, eta=0).capacity(0) == 4

    def test_after_a_batch_is_issued_nothing_more_until_the_version_increments(self):
        m = manager(B=4, eta=0)
        m.on_issued(4)
        m.on_consumed(4)  # trained on, but still at version 0
        assert m.capacity(0) == 0
        assert m.capacity(1) == 4

    def test_a_partial_batch_leaves_the_rest_of_the_slots(self):
        m = manager(B=4, eta=0)
        m.on_issued(3)
        assert m.capacity(0) == 1


class TestOffPolicynessWidensTheWindow:
    def test_eta_allows_eta_extra_batches_ahead(self):
        assert manager(B=4, eta=2).capacity(0) == 12

    def test_the_window_slides_one_batch_per_version(self):
        m = manager(B=4, eta=2)
        m.on_issued(12)
        assert m.capacity(0) == 0
        assert m.capacity(1) == 4
        assert m.capacity(5) == 4 * (2 + 5 + 1) - 12


class TestGivingSlotsBack:
    def test_a_rejected_group_gives_its_slot_back(self):
        m = manager(B=4, eta=0)
        m.on_issued(4)
        m.on_rejected(1)
        assert m.started == 3 and m.capacity(0) == 1

    def test_a_group_dropped_as_stale_gives_its_slot_back(self):
        m = manager(B=4, eta=0)
        m.on_issued(4)
        m.on_dropped(2)
        assert m.capacity(0) == 2

    def test_consumed_groups_do_not_give_slots_back(self):
        m = manager(B=4, eta=1)
        m.on_issued(8)
        m.on_consumed(8)
        assert m.capacity(0) == 0


class TestConcurrencyCap:
    def test_the_cap_limits_groups_in_flight(self):
        m = manager(B=100, eta=5, cap=10)
        assert m.capacity(0) == 10
        m.on_issued(10)
        assert m.capacity(0) == 0

    def test_consuming_frees_room_under_the_cap(self):
        m = manager(B=100, eta=5, cap=10)
        m.on_issued(10)
        m.on_consumed(3)
        m.on_rejected(1)
        assert m.in_flight == 6 and m.capacity(0) == 4

    def test_the_staleness_bound_wins_when_tighter(self):
        m = manager(B=2, eta=0, cap=10)
        assert m.capacity(0) == 2

    def test_an_accepted_group_frees_its_slot_before_it_is_trained(self):
        m = manager(B=100, eta=5, cap=10)
        m.on_issued(10)
        m.on_accepted(4)  # on the bus, waiting to be trained
        assert m.running == 6 and m.capacity(0) == 4


class TestTheFlagshipExampleOverlapsGenerationAndTraining:
    """examples/gsm8k-grpo.yaml: batchSize 256, maxConcurrentRollouts 256, eta 2 (AReaL's numbers).

    Counting a group as in flight until it was trained made engines and trainer take turns whatever
    eta was: nothing could be issued while a batch was collected or trained.
    """

    B, C, ETA = 256, 256, 2

    def test_once_v0s_groups_arrived_the_next_batch_is_issued_while_v0_trains(self):
        m = manager(B=self.B, eta=self.ETA, cap=self.C)
        m.on_issued(m.capacity(0))
        assert m.issued == 256 and m.capacity(0) == 0
        m.on_accepted(256)  # the batch is collected; training v0 starts now, nothing consumed yet
        assert m.capacity(0) == 256, "the engines must get the next 256 prompts while the trainer trains"

    def test_over_several_versions_the_engines_never_wait_for_the_trainer(self):
        m = manager(B=self.B, eta=self.ETA, cap=self.C)
        for v in range(6):
            m.on_issued(m.capacity(v))
            m.on_accepted(self.B)  # the batch for version v arrives
            issued_during_training = m.capacity(v)
            m.on_issued(issued_during_training)
            assert issued_during_training == self.B, f"v{v}: {issued_during_training} issued while training"
            m.on_consumed(self.B)
            assert m.started <= (self.ETA + v + 1) * self.B  # the staleness bound still holds

    def test_the_staleness_bound_still_stops_issuing_eta_batches_ahead(self):
        m = manager(B=self.B, eta=self.ETA, cap=10_000)
        m.on_issued(m.capacity(0))
        m.on_accepted(3 * self.B)
        assert m.capacity(0) == 0  # accepted groups keep their staleness slot until the version moves


class TestStaleGroups:
    @pytest.mark.parametrize(
        ("eta", "head", "version", "stale"),
        [(0, 3, 3, False), (0, 2, 3, True), (2, 1, 3, False), (2, 0, 3, True), (1, None, 10, False)],
    )
    def test_a_group_is_stale_when_its_head_is_older_than_v_minus_eta(self, eta, head, version, stale):
        assert manager(eta=eta).is_stale(head, version) is stale


class TestAccountingErrors:
    def test_consuming_more_than_was_issued_is_an_error_that_says_so(self):
        m = manager()
        m.on_issued(1)
        with pytest.raises(ValueError, match=r"consumed 2 > issued 1"):
            m.on_consumed(2)

    @pytest.mark.parametrize("kwargs", [{"B": 0}, {"eta": -1}, {"cap": 0}])
    def test_bad_settings_name_the_field(self, kwargs):
        with pytest.raises(ValueError, match=r"(batchSize|maxHeadOffpolicyness|maxConcurrentRollouts)"):
            manager(**kwargs)

    def test_negative_counts_are_refused(self):
        with pytest.raises(ValueError, match="count must be an int >= 0"):
            manager().on_issued(-1)


class TestManagerState:
    def test_state_round_trips_and_ignores_the_issuers_keys(self):
        m = manager(B=4, eta=1)
        m.on_issued(8)
        m.on_rejected(1)
        m.on_dropped(1)
        m.on_consumed(3)
        state = {**m.to_state(), "epoch": 2, "position": 5}
        back = StalenessManager.from_state(state, batch_size=4, max_head_offpolicyness=1)
        assert back == m and back.capacity(1) == m.capacity(1)

    def test_accepted_but_untrained_groups_count_as_running_after_a_restore(self):
        # They were not acknowledged by the checkpoint: the bus delivers them again and they are re-accepted.
        m = manager(B=4, eta=1, cap=8)
        m.on_issued(8)
        m.on_accepted(6)
        m.on_consumed(4)
        back = StalenessManager.from_state(m.to_state(), batch_size=4, max_head_offpolicyness=1, max_concurrent=8)
        assert "accepted" not in m.to_state()
        assert back.accepted == 4 and back.running == 4 and back.capacity(2) == 4

    def test_a_state_saved_before_the_accepted_counter_loads(self):
        old = {"issued": 8, "rejected": 1, "dropped": 0, "consumed": 4, "epoch": 0, "position": 8}
        back = StalenessManager.from_state(old, batch_size=4, max_head_offpolicyness=1, max_concurrent=8)
        assert back.accepted == 4 and back.running == 3

    def test_a_state_without_counters_is_refused(self):
        with pytest.raises(ValueError, match=r"lacks \['consumed'\]"):
            StalenessManager.from_state({"issued": 1, "rejected": 0, "dropped": 0}, batch_size=1, max_head_offpolicyness=0)


class TestTicketIssuerOrder:
    def test_each_epoch_issues_every_item_once(self):
        issuer = TicketIssuer(10, seed=3)
        tickets = issuer.issue(10, version=0)
        assert sorted(t.index for t in tickets) == list(range(10))
        assert {t.epoch for t in tickets} == {0}

    def test_ids_are_unique_and_name_epoch_index_and_position(self):
        tickets = TicketIssuer(5, seed=1).issue(15, version=2)
        assert len({t.ticket_id for t in tickets}) == 15
        assert tickets[6].ticket_id == ticket_id(1, tickets[6].index, 1) == f"e1-i{tickets[6].index}-1"
        assert all(t.issued_version == 2 for t in tickets)

    def test_the_order_is_seeded_and_differs_per_epoch(self):
        a, b = TicketIssuer(50, seed=7), TicketIssuer(50, seed=7)
        assert [t.index for t in a.issue(100, 0)] == [t.index for t in b.issue(100, 0)]
        assert a.order(0) != a.order(1)
        assert TicketIssuer(50, seed=8).order(0) != a.order(0)

    def test_without_shuffle_the_order_is_the_data_set_order(self):
        assert [t.index for t in TicketIssuer(4, shuffle=False).issue(4, 0)] == [0, 1, 2, 3]


class TestTicketIssuerEpochs:
    def test_epochs_wrap_and_report_completion(self):
        done = []
        issuer = TicketIssuer(3, on_epoch_end=done.append)
        issuer.issue(2, 0)
        assert done == [] and (issuer.epoch, issuer.position) == (0, 2)
        issuer.issue(5, 0)
        assert done == [0, 1] and (issuer.epoch, issuer.position) == (2, 1)

    def test_it_stops_after_the_last_epoch(self):
        issuer = TicketIssuer(3, epochs=2)
        assert len(issuer.issue(10, 0)) == 6
        assert issuer.exhausted and issuer.issue(1, 0) == []


class TestTicketIssuerResume:
    def test_resuming_from_state_continues_the_same_order(self):
        straight = TicketIssuer(7, seed=5).issue(20, 0)
        first = TicketIssuer(7, seed=5)
        head = first.issue(9, 0)
        resumed = TicketIssuer.from_state(first.to_state(), 7, seed=5)
        assert [t.ticket_id for t in head + resumed.issue(11, 0)] == [t.ticket_id for t in straight]

    def test_a_state_from_another_data_set_or_seed_is_refused(self):
        state = TicketIssuer(7, seed=5).to_state()
        with pytest.raises(ValueError, match="dataset_size=7 but the run has dataset_size=8"):
            TicketIssuer.from_state(state, 8, seed=5)
        with pytest.raises(ValueError, match="seed=5 but the run has seed=6"):
            TicketIssuer.from_state(state, 7, seed=6)

    def test_an_empty_data_set_is_refused(self):
        with pytest.raises(ValueError, match="dataset_size must be an int >= 1, got 0"):
            TicketIssuer(0)


class TestIssuerAndManagerTogether:
    def test_a_synchronous_loop_issues_one_batch_per_version(self):
        m, issuer = manager(B=3, eta=0), TicketIssuer(100)
        per_version = []
        for v in range(4):
            tickets = issuer.issue(m.capacity(v), v)
            m.on_issued(len(tickets))
            per_version.append(len(tickets))
            assert m.capacity(v) == 0
            m.on_consumed(len(tickets))
        assert per_version == [3, 3, 3, 3]
