"""The one ledger of slot credits (weights/slot_credits.py), in both ways the protocols say
credits: a weight group's whole state, and the bucket stream's numbered frees, here driven
through random interleavings of several trainer ranks writing one reader's two slots."""

from __future__ import annotations

import random

import pytest

from transport.weights.slot_credits import ANY, NONE_HELD, SlotCredits

pytestmark = pytest.mark.unit


def test_a_group_credit_says_the_whole_state_and_a_write_spends_its_slot():
    credits = SlotCredits()
    assert not credits and credits.free() == []
    credits.say([1, 0], [7, -1])
    assert credits.free() == [0, 1] and credits.free(but={0}) == [1]
    assert credits.held(1) == 7 and credits.held(0) == NONE_HELD
    assert credits.may_write(0) and credits.may_write(1, ANY)
    credits.spend(0)
    assert credits.free() == [1] and not credits.may_write(0)
    credits.say([2])  # the next credit replaces the ledger: slot 1 is no longer free
    assert credits.free() == [2] and credits.held(2) == NONE_HELD


def test_a_numbered_credit_covers_its_write_and_none_after_it():
    credits = SlotCredits(range(2), numbered=True)
    assert credits.may_write(0, 0) and credits.may_write(1, 1)
    assert not credits.may_write(1, 3)  # bucket 3 waits for slot 1's free of bucket 3
    credits.grant(1, upto=3)
    credits.grant(1, upto=1)  # a late, lower credit changes nothing
    assert credits.may_write(1, 3) and not credits.may_write(1, 5)


def test_a_credit_for_a_later_write_survives_the_spending_of_an_earlier_one():
    credits = SlotCredits(range(2), numbered=True)
    credits.grant(0, upto=2)  # came while bucket 0 was being posted
    credits.spend(0, 0)
    assert credits.may_write(0, 2)
    credits.spend(0, 2)
    assert not credits.may_write(0, 2) and credits.free() == [1]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(40))
def test_ranks_sharing_two_slots_never_overwrite_a_bucket_the_reader_has_not_yielded(ranks, seed):
    """Rank ``r`` writes buckets ``r, r + W, ...`` into slot ``k % 2`` of one reader; the
    reader yields the buckets in order and sends ``Free(k + 2)`` to the rank of bucket ``k + 2``;
    messages arrive late and in any order. Every bucket must arrive, and none into a slot that
    still holds one the reader has not yielded."""
    rng = random.Random(seed)
    buckets = 17
    credits = [SlotCredits(range(2), numbered=True) for _ in range(ranks)]
    nxt = list(range(ranks))  # the next bucket each rank writes
    slots: list[int | None] = [None, None]  # the bucket each slot holds, not yet yielded
    in_flight: list[tuple[int, int]] = []  # (rank, bucket freed) not yet delivered
    yielded: list[int] = []
    while len(yielded) < buckets:
        moves = []
        for r in range(ranks):
            k = nxt[r]
            if k < buckets and credits[r].may_write(k % 2, k):
                moves.append(("write", r))
        if in_flight:
            moves.append(("deliver", rng.randrange(len(in_flight))))
        want = len(yielded)
        if slots[want % 2] == want:
            moves.append(("yield", want))
        assert moves, f"stuck: yielded {yielded}, slots {slots}, credits {credits}"
        what, arg = rng.choice(moves)
        if what == "write":
            k = nxt[arg]
            assert slots[k % 2] is None, f"bucket {k} overwrote bucket {slots[k % 2]}"
            slots[k % 2] = k
            credits[arg].spend(k % 2, k)
            nxt[arg] += ranks
        elif what == "deliver":
            rank, k = in_flight.pop(arg)
            credits[rank].grant(k % 2, upto=k)
        else:
            slots[arg % 2] = None
            yielded.append(arg)
            if arg + 2 < buckets:
                in_flight.append(((arg + 2) % ranks, arg + 2))
    assert yielded == list(range(buckets))
