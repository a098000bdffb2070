"""Bus messages: JSON round trips, compression, validation errors, head version, chunking logic."""

from __future__ import annotations

import random
import zlib
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from kuberl.runtime.bus.chunks import ChunkAssembler
from kuberl.runtime.bus.messages import (
    COMPRESS_ABOVE,
    MessageError,
    Sample,
    Ticket,
    TrajectoryGroup,
    decode_group,
    decode_ticket,
    encode,
    join_chunks,
    split_chunks,
)
from kuberl.runtime.bus.names import (
    H_ATTEMPT,
    H_CHUNK,
    H_CHUNKS,
    H_GROUP,
    H_SIZE,
    BusNames,
)


def sample(n: int = 4, versions: list[int] | None = None, mask: list[int] | None = None, seed: int = 0) -> Sample:
    rng = random.Random(seed)
    return Sample(
        input_ids=[rng.randrange(1000) for _ in range(3)],
        output_ids=[rng.randrange(1000) for _ in range(n)],
        logprobs=[-rng.random() for _ in range(n)],
        versions=versions if versions is not None else [0] * n,
        loss_mask=mask if mask is not None else [1] * n,
        reward=1.0,
    )


def group(samples: list[Sample], gid: str = "e0-i3-0") -> TrajectoryGroup:
    idx = int(gid.split("-i")[1].split("-")[0])
    return TrajectoryGroup(group_id=gid, ticket=Ticket(ticket_id=gid, index=idx, epoch=0, issued_version=0),
                           samples=samples, agent="a", created_at=1.0)


class TestRoundTrips:
    def test_a_ticket_round_trips_as_plain_json(self):
        t = Ticket(ticket_id="e1-i5-2", index=5, epoch=1, issued_version=4)
        data = encode(t)
        assert data.startswith(b"{") and decode_ticket(data) == t

    def test_a_small_group_stays_plain_json(self):
        g = group([sample(), sample(seed=1)])
        data = encode(g)
        assert data.startswith(b"{") and decode_group(data) == g

    def test_a_large_group_is_compressed_and_decodes_the_same(self):
        g = group([sample(n=3000, seed=i) for i in range(4)])
        data = encode(g)
        assert len(g.model_dump_json()) > COMPRESS_ABOVE
        assert not data.startswith(b"{") and len(data) < len(g.model_dump_json()) / 1.5
        assert decode_group(data) == g

    def test_logprobs_survive_exactly(self):
        s = sample(n=50, seed=3)
        assert decode_group(encode(group([s]))).samples[0].logprobs == s.logprobs


class TestDecodingErrors:
    def test_garbage_is_reported_as_neither_json_nor_zlib(self):
        with pytest.raises(MessageError, match="neither JSON nor zlib"):
            decode_group(b"\x00\x01garbage")

    def test_a_missing_field_is_named(self):
        with pytest.raises(MessageError, match=r"bad Ticket: epoch: Field required"):
            decode_ticket(b'{"ticket_id": "x", "index": 1, "issued_version": 0}')

    def test_a_compressed_payload_with_bad_fields_is_reported_too(self):
        with pytest.raises(MessageError, match="bad Ticket: index"):
            decode_ticket(zlib.compress(b'{"ticket_id": "x", "index": -1, "epoch": 0, "issued_version": 0}'))

    def test_an_empty_payload_is_refused(self):
        with pytest.raises(MessageError, match="empty payload"):
            decode_group(b"")


class TestValidation:
    def test_per_token_lists_must_match_output_ids(self):
        with pytest.raises(ValueError, match="logprobs has 2 entries but output_ids has 3"):
            Sample(input_ids=[1], output_ids=[1, 2, 3], logprobs=[0.0, 0.0], versions=[0] * 3, loss_mask=[1] * 3, reward=0)

    def test_loss_mask_is_binary(self):
        with pytest.raises(ValueError, match="loss_mask values must be 0 or 1, got 2"):
            sample(n=2, mask=[1, 2])

    def test_group_id_must_be_the_ticket_id(self):
        with pytest.raises(ValueError, match="must equal ticket.ticket_id"):
            TrajectoryGroup(group_id="x", ticket=Ticket(ticket_id="y", index=0, epoch=0, issued_version=0), samples=[sample()])

    def test_a_rejected_group_has_no_samples_and_an_accepted_one_has_some(self):
        t = Ticket(ticket_id="y", index=0, epoch=0, issued_version=0)
        with pytest.raises(ValueError, match="rejected but has 1 samples"):
            TrajectoryGroup(group_id="y", ticket=t, samples=[sample()], rejected=True)
        with pytest.raises(ValueError, match="has no samples: send it with rejected=true"):
            TrajectoryGroup(group_id="y", ticket=t)


class TestHeadVersion:
    def test_head_version_is_the_oldest_generated_token(self):
        g = group([sample(n=3, versions=[4, 5, 5]), sample(n=2, versions=[6, 6])])
        assert g.head_version == 4

    def test_tokens_not_generated_by_the_policy_are_ignored(self):
        s = sample(n=4, versions=[-1, 7, -1, 8], mask=[0, 1, 0, 1])
        assert s.head_version == 7 and group([s]).head_version == 7

    def test_a_group_without_generated_tokens_has_no_head_version(self):
        assert group([sample(n=2, versions=[-1, -1], mask=[0, 0])]).head_version is None


class TestChunkSplitting:
    def test_split_then_join_restores_the_payload(self):
        payload = bytes(range(256)) * 41
        parts = split_chunks(payload, 1000)
        assert all(len(p) <= 1000 for p in parts) and len(parts) == 11
        assert join_chunks(dict(enumerate(parts)), len(parts), len(payload)) == payload

    def test_missing_chunks_and_wrong_sizes_are_named(self):
        parts = dict(enumerate(split_chunks(b"x" * 30, 10)))
        del parts[1]
        with pytest.raises(MessageError, match=r"chunks \[1\] of 3 are missing"):
            join_chunks(parts, 3)
        with pytest.raises(MessageError, match="reassembled 30 bytes but the group header says 31"):
            join_chunks(dict(enumerate(split_chunks(b"x" * 30, 10))), 3, 31)


def fake(subject: str, data: bytes, headers: dict[str, str] | None, ts: float) -> SimpleNamespace:
    meta = SimpleNamespace(timestamp=datetime.fromtimestamp(ts, UTC))
    return SimpleNamespace(subject=subject, data=data, headers=headers, metadata=meta)


def chunked(gid: str, attempt: str, payload: bytes, size: int, ts: float) -> tuple[list[SimpleNamespace], SimpleNamespace]:
    parts = split_chunks(payload, size)
    chunks = [fake("c", p, {H_GROUP: gid, H_ATTEMPT: attempt, H_CHUNK: str(i), H_CHUNKS: str(len(parts))}, ts)
              for i, p in enumerate(parts)]
    head = fake("t", b"", {H_GROUP: gid, H_ATTEMPT: attempt, H_CHUNKS: str(len(parts)), H_SIZE: str(len(payload))}, ts)
    return chunks, head


class TestChunkAssembler:
    def test_a_plain_message_passes_straight_through(self):
        m = fake("t", b"{}", {H_GROUP: "g"}, 1)
        assert ChunkAssembler().add(m) == (b"{}", [m])

    def test_interleaved_groups_are_reassembled_with_all_their_messages(self):
        a_chunks, a_head = chunked("a", "1", b"A" * 25, 10, 1)
        b_chunks, b_head = chunked("b", "2", b"B" * 15, 10, 1)
        asm = ChunkAssembler()
        order = [a_chunks[0], b_chunks[0], a_chunks[1], b_chunks[1], b_head, a_chunks[2], a_head]
        results = [r for m in order if (r := asm.add(m)) is not None]
        assert [r[0] for r in results] == [b"B" * 15, b"A" * 25]
        assert results[1][1] == [a_head, *a_chunks]  # head first: acked first
        assert asm.buffered == 0 and asm.sweep() == []

    def test_a_head_that_arrives_before_its_chunks_waits_for_them(self):
        chunks, head = chunked("a", "1", b"A" * 25, 10, 1)
        asm = ChunkAssembler()
        assert asm.add(head) is None and asm.add(chunks[2]) is None and asm.add(chunks[0]) is None
        assert asm.add(chunks[1])[0] == b"A" * 25

    def test_a_redelivered_chunk_replaces_the_earlier_copy(self):
        chunks, head = chunked("a", "1", b"A" * 20, 10, 1)
        again = fake("c", chunks[0].data, chunks[0].headers, 2)
        asm = ChunkAssembler()
        for m in (chunks[0], again, chunks[1]):
            assert asm.add(m) is None
        assert asm.add(head)[1] == [head, again, chunks[1]]

    def test_chunks_of_a_superseded_attempt_are_swept_when_the_winner_arrives(self):
        old, _ = chunked("a", "old", b"X" * 20, 10, 1)
        new, head = chunked("a", "new", b"Y" * 20, 10, 2)
        asm = ChunkAssembler()
        for m in old + new:
            asm.add(m)
        assert asm.add(head)[0] == b"Y" * 20
        swept = asm.sweep()
        assert [m for m, _ in swept] == old and "superseded attempt old" in swept[0][1]

    def test_chunks_whose_head_never_comes_are_swept_after_the_grace_period(self):
        orphan, _ = chunked("a", "1", b"X" * 20, 10, ts=100)
        asm = ChunkAssembler(grace=60)
        for m in orphan:
            asm.add(m)
        asm.add(fake("t", b"{}", None, 150))
        assert asm.sweep() == []  # the stream has not moved far enough past them
        asm.add(fake("t", b"{}", None, 161))
        swept = asm.sweep()
        assert [m for m, _ in swept] == orphan and "never got their head" in swept[0][1]

    def test_a_size_mismatch_dooms_the_group_instead_of_decoding_garbage(self):
        chunks, head = chunked("a", "1", b"A" * 20, 10, 1)
        head.headers[H_SIZE] = "21"
        asm = ChunkAssembler()
        for m in chunks:
            asm.add(m)
        assert asm.add(head) is None
        assert len(asm.sweep()) == 3


class TestNames:
    def test_names_follow_the_contract(self):
        n = BusNames.for_experiment("my-exp")
        assert (n.tickets_stream, n.tickets_subject) == ("KUBERL_MY_EXP_TICKETS", "kuberl.my-exp.tickets")
        assert (n.traj_stream, n.traj_subject, n.chunk_subject) == ("KUBERL_MY_EXP_TRAJ", "kuberl.my-exp.traj", "kuberl.my-exp.traj.chunk")
        assert (n.kv_bucket, n.weights_bucket) == ("kuberl_MY_EXP", "kuberl_MY_EXP_weights")

    @pytest.mark.parametrize("bad", ["", "My-Exp", "a.b", "-a", "a" * 64])
    def test_names_that_are_not_dns_labels_are_refused(self, bad):
        with pytest.raises(ValueError, match="is not a DNS-1123 label"):
            BusNames.for_experiment(bad)
