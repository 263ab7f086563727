"""Counters kept in a store that anyone with access to it may have overwritten with garbage.

A counter is a key whose value is a decimal integer that :meth:`Store.add` keeps. Whoever can
write the store can put anything there: bytes that are not a number, an empty value, a negative
or a huge number. The stores do not agree on what ``add`` then does (measured: torch 2.13,
Redis 7):

* Redis refuses (``StoreError``) anything but a canonical decimal integer (no ``+``, no
  leading zero, no space) and to pass 2**63 - 1; the memory store refuses anything but decimal
  digits with an optional ``-``;
* TCPStore drops the connection on a value that does not start with a number below 2**63
  (``StoreError``), parses a leading number and ignores the rest (``b"12abc"`` gives 12, and
  ``add(key, 0)`` *writes back* ``b"12"``), and wraps at 2**63 to a negative number.

So a counter is read here with ``try_get`` and parsed strictly, never with ``add(key, 0)``: on
TCPStore that read would itself turn garbage into a smaller number than the counter held, which
would hand out values again. A value that is not a canonical decimal integer from 0 to the
counter's limit is garbage. Readers that cannot repair safely ignore it (:meth:`Counter.read`
gives None, with a warning naming the key); writers repair it first (:meth:`Counter.add`):
compare-and-set from the garbage they saw to a *floor* the owner of the counter chooses, a value
no smaller than any the counter handed out that anyone may still hold. Compare-and-set never
overwrites a concurrent repair or add: the loser reads again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from transport.errors import StoreError
from transport.store.base import Store

log = logging.getLogger(__name__)

#: the largest value a counter may hold: exact as a float, far below 2**63 (where TCPStore wraps
#: and Redis refuses) and below the 2**62 a peer record's generation may reach
MAX_COUNTER = 1 << 53
#: the most members a membership index (``members/count``) holds: ``names()`` reads every index
#: up to the count, so a count must be small enough to read
MAX_MEMBERS = 1 << 16
#: what a membership count is repaired to beyond the last index found in use: a joiner that took
#: an index just before the garbage was written may not have written its name yet
INDEX_MARGIN = 8
#: a scan for the last index in use ends after this many missing indices in a row
INDEX_GAP = 4 * INDEX_MARGIN
#: turns of read, repair and add before a counter that keeps changing to garbage is an error
_TURNS = 8

_CANONICAL = re.compile(rb"0|[1-9][0-9]{0,15}")


def clock_floor() -> int:
    """Milliseconds since 1970: a safe floor for a counter that counts events from 0 by one.

    Counted events (joins, leaves, dump requests) would need more than 50 years at 1,000 a
    second to reach it, so it is larger than any value such a counter handed out; and it is
    larger than an earlier repair to the clock plus the events counted since, as long as fewer
    than one event a millisecond happened meanwhile (and the hosts' clocks agree that closely).
    """
    return time.time_ns() // 1_000_000


def last_index(store: Store, prefix: str, limit: int = MAX_MEMBERS) -> int:
    """The last index ``i`` (from 1) whose key ``prefix + str(i)`` exists, scanning up to
    ``limit`` and stopping after ``INDEX_GAP`` missing ones in a row: one round trip per index,
    for a repair only."""
    last, i = 0, 1
    while i <= limit and i - last <= INDEX_GAP:
        if store.try_get(prefix + str(i)) is not None:
            last = i
        i += 1
    return last


def index_counter(store: Store, prefix: str, what: str) -> Counter:
    """The count of a membership index: the names live under ``prefix + str(i)`` for i from 1 to
    the count. Garbage there is repaired to the last index found in use plus ``INDEX_MARGIN``:
    the count must never fall below an index in use, or the next joiner would overwrite that
    member's name and it would vanish from the index; the gaps above are skipped by readers."""
    return Counter(
        store,
        prefix + "count",
        what,
        lambda: min(MAX_MEMBERS, last_index(store, prefix) + INDEX_MARGIN),
        MAX_MEMBERS,
    )


class Counter:
    """One counter key of a store that may hold garbage (see the module docstring).

    It owns the key, what the counter counts (``what``, for messages), the largest value it
    accepts (``limit``) and the way to a safe value after garbage (``floor``, called only to
    repair), plus the last garbage it warned about (each distinct value is reported once, so a
    reader polling a damaged key does not flood the log). Rules: :meth:`read` never writes;
    :meth:`value`, :meth:`add` and :meth:`raise_to` repair garbage by compare-and-set first; a
    value is lowered only from garbage or from its limit, and only to the floor; every call is a few store round trips, as
    thread-safe as the store. A StoreError of the store itself (unreachable, timed out) passes
    through.
    """

    def __init__(
        self,
        store: Store,
        key: str,
        what: str,
        floor: Callable[[], int] = clock_floor,
        limit: int = MAX_COUNTER,
    ) -> None:
        self.store, self.key, self.what = store, key, what
        self.floor, self.limit = floor, limit
        self._warned: bytes | None = None

    def parse(self, raw: bytes | None) -> int | None:
        """The value of ``raw`` (a missing key counts 0), or None for garbage."""
        if raw is None:
            return 0
        if not _CANONICAL.fullmatch(raw):
            return None
        n = int(raw)
        return n if n <= self.limit else None

    def read(self) -> int | None:
        """The counter's value; None (with a warning naming the key) when it holds garbage."""
        raw = self.store.try_get(self.key)
        n = self.parse(raw)
        if n is None:
            self._warn(raw, "ignored until a writer repairs it")
        return n

    def missing(self) -> bool:
        """Whether the store holds no value for the counter (never counted, or lost)."""
        return self.store.try_get(self.key) is None

    def value(self) -> int:
        """The counter's value, repairing garbage first."""
        for _ in range(_TURNS):
            raw = self.store.try_get(self.key)
            n = self.parse(raw)
            if n is not None:
                return n
            self._repair(raw, self.floor())
        raise self._unstable()

    def add(self, amount: int = 1) -> int:
        """Add ``amount`` (>= 0) atomically and return the new value, repairing garbage first. A
        value the counter cannot go on from (its limit) is repaired to the floor too, when that
        is lower; if it is not, the counter is full: StoreError."""
        for _ in range(_TURNS):
            raw = self.store.try_get(self.key)
            n = self.parse(raw)
            if n is None or n + amount > self.limit:
                floor = self.floor()
                if n is not None and floor >= n:
                    raise StoreError(
                        f"counter {self.key} ({self.what}) is at {n}, and adding {amount} would "
                        f"pass its limit of {self.limit}; start a new namespace or group"
                    )
                self._repair(raw, floor)
                continue
            try:
                new = self.store.add(self.key, amount)
            except StoreError:
                if self.parse(self.store.try_get(self.key)) is not None:
                    raise  # the value is fine: the store failed
                continue  # garbage was written since we looked: repaired next turn
            if 0 <= new <= self.limit:
                return new
            # garbage that TCPStore took for a number was written since we looked (or it
            # wrapped): the value it left is out of range, so the next turn repairs it
        raise self._unstable()

    def raise_to(self, value: int) -> None:
        """Make the counter at least ``value``. Garbage is set to ``value`` itself, not to the
        floor: for a caller that knows ``value`` is the newest the counter handed out."""
        for _ in range(_TURNS):
            raw = self.store.try_get(self.key)
            n = self.parse(raw)
            if n is None:
                self._repair(raw, value)
                continue
            if n < value:
                self.store.add(self.key, value - n)
            return
        raise self._unstable()

    def _repair(self, raw: bytes | None, floor: int) -> None:
        if not 0 <= floor <= self.limit:
            raise StoreError(
                f"counter {self.key} ({self.what}) holds {_shown(raw)}, and the value it would "
                f"be repaired to, {floor}, is outside 0 to {self.limit}; start a new namespace or "
                "group"
            )
        self._warn(raw, f"repairing it to {floor}")
        self.store.compare_set(self.key, raw, str(floor).encode())  # lost: read again

    def _warn(self, raw: bytes | None, action: str) -> None:
        if raw != self._warned:
            self._warned = raw
            log.warning(
                "store key %s holds %s, not a value the counter of %s can go on from (a decimal "
                "integer from 0 to %d); %s",
                self.key,
                _shown(raw),
                self.what,
                self.limit,
                action,
            )

    def _unstable(self) -> StoreError:
        return StoreError(
            f"counter {self.key} ({self.what}) kept changing to something that is not a decimal "
            "integer; stop whatever writes it, or delete the key"
        )


def _shown(raw: bytes | None) -> str:
    return "nothing" if raw is None else repr(raw[:40]) + (" ..." if len(raw) > 40 else "")


__all__ = ["MAX_COUNTER", "MAX_MEMBERS", "Counter", "clock_floor", "index_counter", "last_index"]
