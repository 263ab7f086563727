"""Slot credits: the flow control of both weight protocols, one ledger.

A reader (a subscriber of a weight group, a rollout worker of the bucket stream) owns a few
slots that its writers put bytes into. A writer writes a slot only while it holds a credit for
it, and the write spends that credit; the reader credits the slot again once it is done with
what the slot held. :class:`SlotCredits` is what one writer knows of one reader's credits. Both
protocols keep one per reader, under their own lock, and say credits in one of two ways:

* a weight group's ``Credit`` says the reader's whole state (:meth:`SlotCredits.say`): these
  slots are free now, for whatever the writer writes next, and each holds that version whole
  (a delta written there applies onto it);
* the bucket stream's ``Free(k)`` frees one slot for one write of a numbered stream
  (:meth:`SlotCredits.grant` with ``upto=k``): slot ``k % 2`` may take bucket ``k`` and none
  before it. The number matters because several trainer ranks write one reader's two slots in
  turn: a rank may write bucket ``k`` only once the reader has yielded bucket ``k - 2``,
  whichever rank wrote it (a credit without a number would let it overwrite that bucket), and
  a credit that comes while its slot's previous write is still being posted must survive that
  write's spending (:meth:`SlotCredits.spend` spends only what the write covers).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

#: a credit for whatever write comes next (the weight groups' kind)
ANY = sys.maxsize
#: the version a credited slot holds when the reader did not say (or holds none whole)
NONE_HELD = -1


@dataclass(frozen=True)
class SlotCredit:
    """A credit for one slot: the writes it covers (numbers up to ``upto``), and the version
    the slot holds whole (``held``; NONE_HELD: none, or not said)."""

    upto: int = ANY
    held: int = NONE_HELD


class SlotCredits:
    """One reader's credited slots, as one writer knows them: slot -> :class:`SlotCredit`.

    Rules: a slot may be written only on a credit that covers the write's number
    (:meth:`may_write`); a write spends the credit it used, and only that one
    (:meth:`spend`); a numbered credit only ever grows (:meth:`grant` keeps the higher);
    :meth:`say` replaces the whole ledger with what the reader says now. Not thread-safe: its
    owner holds its own lock around every call."""

    def __init__(self, slots: Iterable[int] = (), *, numbered: bool = False) -> None:
        """Credits for ``slots`` to start with: for any write, or (``numbered``) slot ``k``
        for write ``k`` (a stream's first writes, one per slot)."""
        self._credits: dict[int, SlotCredit] = {
            slot: SlotCredit(slot if numbered else ANY) for slot in slots
        }

    def say(self, slots: Iterable[int], held: Iterable[int] = ()) -> None:
        """The reader's whole state: exactly ``slots`` are free, for any write; ``held``, per
        slot in ``slots``, the version it holds whole (fewer: NONE_HELD for the rest)."""
        helds = list(held)
        self._credits = {
            slot: SlotCredit(ANY, helds[i] if i < len(helds) else NONE_HELD)
            for i, slot in enumerate(slots)
        }

    def grant(self, slot: int, upto: int = ANY) -> None:
        """Credit ``slot`` for the writes numbered up to ``upto`` (a lower credit than the one
        held changes nothing: it came late)."""
        now = self._credits.get(slot)
        if now is None or now.upto < upto:
            self._credits[slot] = SlotCredit(upto)

    def may_write(self, slot: int, number: int = 0) -> bool:
        """Whether write ``number`` may go into ``slot``."""
        credit = self._credits.get(slot)
        return credit is not None and credit.upto >= number

    def spend(self, slot: int, number: int = ANY) -> None:
        """Write ``number`` went into ``slot``: its credit is spent, unless the credit is a
        later one (granted for a later write while this one was being posted)."""
        credit = self._credits.get(slot)
        if credit is not None and credit.upto <= number:
            del self._credits[slot]

    def free(self, but: Iterable[int] = ()) -> list[int]:
        """The credited slots, lowest first, except those in ``but``."""
        skip = set(but)
        return sorted(s for s in self._credits if s not in skip)

    def held(self, slot: int) -> int:
        """The version credited ``slot`` holds whole (NONE_HELD: none, or not credited)."""
        credit = self._credits.get(slot)
        return NONE_HELD if credit is None else credit.held

    def __bool__(self) -> bool:
        return bool(self._credits)

    def __repr__(self) -> str:
        return f"SlotCredits({self._credits!r})"
