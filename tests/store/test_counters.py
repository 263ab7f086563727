"""Counters that hold garbage, on every store: readers ignore it, writers repair it to the floor
and go on counting from there, and the last index of a membership index survives a repair."""

from __future__ import annotations

import logging

import pytest

from transport import Store, StoreError
from transport.store.counters import (
    INDEX_MARGIN,
    MAX_COUNTER,
    MAX_MEMBERS,
    Counter,
    index_counter,
)

pytestmark = [pytest.mark.stores, pytest.mark.timeout(30)]

# what an outsider or a bug may leave where a counter belongs: not a number, empty, negative,
# over 2**63 (Redis refuses it, TCPStore cannot parse it), just under 2**63 (TCPStore wraps to a
# negative number on the next add), a number TCPStore parses and cuts short, leading zeros
# (Redis refuses them), and the 0xFF mark that our TCPStore header starts with
GARBAGE = [
    b"not a number",
    b"",
    b"-5",
    b"99999999999999999999999",
    b"9223372036854775807",
    b"12abc",
    b"007",
    b"\xff\x00junk",
]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_is_ignored_by_readers_and_repaired_by_writers(store: Store, garbage, caplog):
    counter = Counter(store, "c", "test events", floor=lambda: 1000)
    assert counter.add(1) == 1
    store.set("c", garbage)
    with caplog.at_level(logging.WARNING, "transport.store"):
        assert counter.read() is None
        assert store.try_get("c") == garbage  # a reader writes nothing
        assert "store key c holds" in caplog.text and "test events" in caplog.text
        assert counter.add(1) == 1001  # from the floor, never from the garbage
    assert store.try_get("c") == b"1001"
    assert counter.read() == 1001 and counter.value() == 1001


@pytest.mark.parametrize("garbage", [b"not a number", b"-1", b"70000"])
def test_a_membership_count_is_repaired_above_its_last_index_in_use(store: Store, garbage):
    count = index_counter(store, "m/", "test members")
    for name in (b"a", b"b", b"c"):
        store.set(f"m/{count.add(1)}", name)
    store.delete("m/2")  # a gap: a joiner that took an index and died before writing its name
    store.set("m/count", garbage)
    assert count.value() == 3 + INDEX_MARGIN
    assert count.add(1) == 4 + INDEX_MARGIN  # "c" (index 3) keeps its place
    assert count.value() <= MAX_MEMBERS


def test_a_counter_at_its_limit_is_repaired_to_its_floor_unless_that_is_as_high(store: Store):
    counter = Counter(store, "c", "test events", floor=lambda: 1000)
    store.set("c", str(MAX_COUNTER).encode())
    assert counter.read() == MAX_COUNTER  # a number in range: readers take it
    assert counter.add(1) == 1001
    count = index_counter(store, "m/", "test members")
    store.set("m/1", b"a")
    store.set("m/count", str(MAX_MEMBERS).encode())
    assert count.add(1) == 2 + INDEX_MARGIN
    full = Counter(store, "f", "test members", floor=lambda: MAX_MEMBERS, limit=MAX_MEMBERS)
    store.set("f", str(MAX_MEMBERS).encode())
    with pytest.raises(StoreError, match="would pass its limit of 65536; start a new"):
        full.add(1)
    assert full.value() == MAX_MEMBERS
