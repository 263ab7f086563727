"""Senders without a secret: frames of an unchecked agent wait in order, bounded, and are
delivered on the engine thread only."""

from __future__ import annotations

from transport.senders import MAX_HELD_BYTES, MAX_HELD_FRAMES, Senders


def test_frames_that_come_during_the_check_are_delivered_after_the_held_ones():
    s = Senders()
    assert s.hold("a#1", [b"1", b"2"]) == 0
    assert s.holding("a#1") and not s.known("a#1")
    assert s.waiting() == ["a#1"]
    s.hold("a#1", [b"3"])  # arrives while the check runs: it waits behind
    assert not s.releasable
    s.prove("a#1")  # housekeeping: proven, but it delivers nothing itself
    assert s.releasable and s.waiting() == []
    s.hold("a#1", [b"4"])  # still held: the engine has not released the others yet
    assert s.release() == [("a#1", [b"1", b"2", b"3", b"4"])]
    assert s.known("a#1") and not s.holding("a#1") and not s.releasable
    assert s.release() == []


def test_a_refused_agent_loses_what_it_held_and_is_checked_again_next_time():
    s = Senders()
    s.hold("m#1", [b"x"])
    assert s.waiting() == ["m#1"]
    s.hold("m#1", [b"y"])
    assert s.forget("m#1") == 2
    assert not s.holding("m#1") and not s.known("m#1")
    assert s.waiting() == [] and s.release() == []


def test_held_frames_are_bounded_in_count_and_bytes_until_released():
    s = Senders()
    assert s.hold("a#1", [b"f"] * (MAX_HELD_FRAMES + 5)) == 5
    assert s.hold("b#1", [b"g"]) == 1  # full: another agent's frames are refused too
    s.prove("a#1")
    assert len(s.release()[0][1]) == MAX_HELD_FRAMES  # delivered: room again
    big = b"z" * (1 << 20)
    n = MAX_HELD_BYTES // len(big)
    assert s.hold("c#1", [big] * (n + 2)) == 2
