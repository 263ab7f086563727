"""A staging subscriber's slots (subscribing/slots.py): which slot may be made a copy of the
newest version (primed, for a delta to apply onto) and which may not."""

from __future__ import annotations

import threading

import pytest

from transport.weights.subscribing.slots import Slots

pytestmark = pytest.mark.unit


def test_a_slot_a_version_is_arriving_in_is_never_primed_when_its_forward_ends():
    # found by transport chaos: a relay applied version 137 with part of its first tensor
    # holding version 136 (the newest before it), and forwarded it so to its child
    slots = Slots(2, threading.Condition())
    slots.landed(0, 136)  # the newest version, in slot 0
    slots.begin(1, 137)  # a publisher writes 137 into slot 1 (credited while it was free)
    slots.pin(1)  # the relay forwards 137 from slot 1 as it arrives
    before = slots.free()
    assert before == []
    slots.unpin(1)  # the forward ended before 137 landed here: slot 1 is free again
    assert slots.to_prime(before) is None  # not a copy of 136 over the arriving 137
    slots.landed(1, 137)
    assert slots.holds(1) == 137 and slots.newest == 1


def test_a_slot_that_just_became_free_and_holds_an_older_version_is_primed():
    slots = Slots(2, threading.Condition())
    slots.landed(1, 5)
    slots.landed(0, 6)  # the newest; slot 1 holds 5
    slots.pin(1)  # a forward reads 5 from slot 1
    before = slots.free()
    slots.unpin(1)
    assert slots.to_prime(before) == (0, [1])  # a copy of 6 for the next version's changes
    assert 1 in slots.priming and slots.free() == []
    slots.primed(0, [1], ok=True)
    assert slots.holds(1) == 6
