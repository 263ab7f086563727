"""Senders without a secret: frames of an unchecked agent wait in order, bounded, and are
delivered on the engine thread only; what a flood of agents costs in store reads is bounded."""

from __future__ import annotations

import pytest

from transport.peers.senders import (
    CHECKS_PER_ROUND,
    HOLD_S,
    MAX_HELD_BYTES,
    MAX_HELD_FRAMES,
    REFUSE_S,
    Senders,
)

pytestmark = pytest.mark.unit


def test_frames_that_come_during_the_check_are_delivered_after_the_held_ones():
    s = Senders()
    assert s.hold("a#1", [b"1", b"2"], 0.0) == 0
    assert s.holding("a#1") and not s.known("a#1")
    assert s.due(0.0, 1.0) == ["a#1"]
    s.hold("a#1", [b"3"], 0.1)  # arrives while the check runs: it waits behind
    assert not s.releasable
    s.prove("a#1")  # housekeeping: proven, but it delivers nothing itself
    assert s.releasable and s.due(5.0, 1.0) == []
    s.hold("a#1", [b"4"], 0.2)  # still held: the engine has not released the others yet
    # released with when the last of them came (what counts as hearing from it: liveness)
    assert s.release() == [("a#1", [b"1", b"2", b"3", b"4"], 0.2)]
    assert s.known("a#1") and not s.holding("a#1") and not s.releasable
    assert s.release() == []


def test_an_agent_the_store_does_not_show_yet_is_asked_again_each_interval_until_it_expires():
    s = Senders()
    s.hold("late#1", [b"x"], 10.0)
    assert s.due(10.0, 1.0) == ["late#1"]
    assert s.due(10.5, 1.0) == []  # asked within the interval: no second store read
    assert s.due(11.0, 1.0) == ["late#1"] and not s.expired("late#1", 11.0)
    assert s.expired("late#1", 10.0 + HOLD_S)
    assert s.forget("late#1") == 1 and not s.refused("late#1", 15.0)


def test_an_agent_that_is_someone_else_loses_its_frames_and_is_refused_on_receipt_for_a_while():
    s = Senders()
    s.hold("m#1", [b"x"], 0.0)
    assert s.due(0.0, 1.0) == ["m#1"]
    s.hold("m#1", [b"y"], 0.1)
    assert s.forget("m#1", 0.1 + REFUSE_S) == 2
    assert not s.holding("m#1") and not s.known("m#1")
    assert s.refused("m#1", 1.0) and not s.refused("m#1", 0.2 + REFUSE_S)  # then asked again
    assert s.due(1.0, 1.0) == [] and s.release() == []


def test_a_round_asks_the_store_about_the_agents_that_waited_longest_at_most_a_bound():
    s = Senders()
    agents = [f"flood-{i}#1" for i in range(CHECKS_PER_ROUND + 10)]
    for i, agent in enumerate(agents):
        s.hold(agent, [b"f"], float(i))
    assert s.due(1000.0, 1.0) == agents[:CHECKS_PER_ROUND]
    assert s.due(1000.0, 1.0) == agents[CHECKS_PER_ROUND:]
    assert s.due(1000.5, 1.0) == []


def test_held_frames_are_bounded_in_count_and_bytes_until_released():
    s = Senders()
    assert s.hold("a#1", [b"f"] * (MAX_HELD_FRAMES + 5), 0.0) == 5
    assert s.hold("b#1", [b"g"], 0.0) == 1  # full: another agent's frames are refused too
    s.prove("a#1")
    assert len(s.release()[0][1]) == MAX_HELD_FRAMES  # delivered: room again
    big = b"z" * (1 << 20)
    n = MAX_HELD_BYTES // len(big)
    assert s.hold("c#1", [big] * (n + 2), 0.0) == 2
