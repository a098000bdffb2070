"""The ticket book: AReaL's staleness bound, with the trainer as the authority."""

from __future__ import annotations

import pytest

from kuberl.runtime.trainer.tickets import SeenGroups, TicketBook


def book(**kw) -> TicketBook:
    return TicketBook(**{"num_items": 10, "batch_size": 4, "eta": 1, "seed": 1, **kw})


class TestTheBound:
    def test_at_version_v_at_most_eta_plus_v_plus_one_batches_are_started(self):
        b = book(eta=2)
        assert len(b.next_tickets(0)) == 3 * 4
        assert b.next_tickets(0) == []  # nothing more until the version moves
        assert len(b.next_tickets(1)) == 4
        assert b.started == (2 + 1 + 1) * 4

    def test_eta_zero_is_synchronous(self):
        b = book(eta=0)
        assert len(b.next_tickets(0)) == 4
        b.on_consumed(4)
        assert len(b.next_tickets(1)) == 4

    def test_rejected_and_dropped_groups_give_their_slot_back(self):
        b = book(eta=0)
        b.next_tickets(0)
        b.on_rejected()
        b.on_dropped()
        assert len(b.next_tickets(0)) == 2
        assert b.issued == 6 and b.started == 4

    def test_max_concurrent_limits_groups_in_flight(self):
        b = book(eta=5, max_concurrent=3)
        assert len(b.next_tickets(0)) == 3
        b.on_consumed(2)
        assert len(b.next_tickets(0)) == 2

    def test_no_more_groups_are_started_than_training_uses(self):
        b = book(eta=5, total_groups=6)
        assert len(b.next_tickets(0)) == 6
        b.on_rejected()
        assert len(b.next_tickets(9)) == 1


class TestTicketsAndData:
    def test_each_epoch_visits_every_item_once_in_a_seeded_order(self):
        b = book(eta=100)
        assert b.epoch == 0
        tickets = b.next_tickets(0)[:20]
        first, second = tickets[:10], tickets[10:]
        assert sorted(t.index for t in first) == list(range(10)) == sorted(t.index for t in second)
        assert [t.index for t in first] != [t.index for t in second]
        assert {t.epoch for t in first} == {0} and {t.epoch for t in second} == {1}
        assert [t.index for t in book(eta=100).next_tickets(0)[:10]] == [t.index for t in first]

    def test_ticket_ids_are_deterministic_so_reissuing_after_a_restart_dedupes(self):
        a = book(eta=0)
        issued = a.next_tickets(0)
        restored = book(eta=0)
        restored.load_state(book(eta=0).state())
        assert restored.next_tickets(0) == issued
        assert issued[0].ticket_id == f"e0-i{issued[0].index}-0" and issued[0].issued_version == 0

    def test_state_round_trips(self):
        a = book()
        a.next_tickets(0)
        a.on_rejected()
        a.on_consumed(2)
        b = book()
        b.load_state(a.state())
        assert (b.issued, b.rejected, b.dropped, b.consumed, b.epoch) == (a.issued, a.rejected, a.dropped, a.consumed, a.epoch)
        assert a.state()["position"] == 8 and a.state()["started"] == 7 and a.state()["epoch"] == 0

    def test_a_state_without_a_counter_is_refused_by_name(self):
        with pytest.raises(ValueError, match="lacks \\['consumed'\\]"):
            book().load_state({"issued": 1, "rejected": 0, "dropped": 0, "epoch": 0, "position": 1})

    def test_a_state_saved_with_another_seed_is_refused(self):
        state = book(seed=1).state()
        with pytest.raises(ValueError, match="seed=1 but the run has seed=2"):
            book(seed=2).load_state(state)

    def test_an_empty_data_set_is_refused(self):
        with pytest.raises(ValueError, match="at least one item"):
            book(num_items=0)


class TestCatchUpAfterARestart:
    """A restarted trainer resumes the book from its checkpoint, then moves it to the bus's later copy."""

    def test_tickets_issued_after_the_checkpoint_are_counted_not_issued_again(self):
        before_crash = book(eta=2)
        before_crash.next_tickets(0)
        at_checkpoint = before_crash.state()
        later = before_crash.next_tickets(1)  # issued after the checkpoint, then the trainer died
        restarted = book(eta=2)
        restarted.load_state(at_checkpoint)
        assert restarted.catch_up(before_crash.state()) == len(later) == 4
        assert restarted.issued == before_crash.issued and restarted.started == before_crash.started
        # The next tickets continue after the ones already on the bus, in the same data order.
        assert restarted.next_tickets(2)[0].ticket_id == before_crash.next_tickets(2)[0].ticket_id

    def test_without_a_copy_or_with_one_behind_the_checkpoint_nothing_changes(self):
        b = book()
        b.next_tickets(0)
        stale = book().state()
        assert b.catch_up(None) == 0 and b.catch_up({}) == 0 and b.catch_up(stale) == 0
        assert b.issued == 8

    def test_a_copy_made_with_another_data_order_is_ignored(self):
        other = book(seed=2)
        other.next_tickets(0)
        b = book()
        assert b.catch_up(other.state()) == 0 and b.issued == 0


class TestSeenGroups:
    def test_a_repeated_id_is_spotted_and_the_memory_is_bounded(self):
        seen = SeenGroups(size=3)
        assert [seen.add(i) for i in ("a", "b", "a")] == [True, True, False]
        for i in ("c", "d", "e"):
            seen.add(i)
        assert seen.add("a"), "forgotten after `size` newer ids"
        assert not seen.add("e")
