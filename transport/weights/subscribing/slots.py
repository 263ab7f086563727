"""A staging subscriber's slots: what each holds, and which of them a writer may take."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Slots:
    """Owns the state of a subscriber's ``count`` staging slots: the version each holds (-1:
    none), the newest complete version's slot (``newest``), the slot a read or apply holds
    (``held``; -1 while pull() writes the live tensors), forwards reading each slot
    (``forwarding``), versions a publisher gave up per slot (``aborted``), whether the newest
    version's slot was handed back (``handed_back``: applied and no longer readable, as with
    one slot or a lend), the newest version a publisher asked to lend a slot for, and (in place)
    whether a write of another version began since the last version landed (``dirty``: the
    live tensors may be torn).

    Rules: the subscriber's lock guards it, every call but :meth:`pulling` is made under that
    lock (which ``lock`` is). A writer takes
    only :meth:`free` slots: never the newest complete version's (until handed back), the held
    one, or one a forward or a patch reads; one read or apply at a time.
    """

    def __init__(self, count: int, lock: threading.Condition) -> None:
        self.count = count
        self.lock = lock
        self.version: list[int] = [-1] * count
        self.newest: int | None = None
        self.held: int | None = None
        self.handed_back = False
        self.forwarding: dict[int, int] = {}  # slot -> readers of it (forwards, patches)
        self.aborted: dict[int, int] = {}  # slot -> a version written there that was given up
        self.lend_for = -1
        self.dirty = False  # in place: a write began since the last version landed, and failed

    def landed(self, slot: int, version: int) -> None:
        """``version`` is complete in ``slot``: the newest."""
        self.version[slot] = version
        self.newest = slot
        self.handed_back = False
        self.dirty = False

    def free(self) -> list[int]:
        """The slots a publisher may write. Never the newest version's, except the only slot
        once that version was applied (then it is no longer readable)."""
        newest = None if self.handed_back else self.newest
        busy = {self.held, newest} | {k for k, n in self.forwarding.items() if n}
        return [k for k in range(self.count) if k not in busy]

    def hold(self, slot: int) -> None:
        """Keep ``slot`` from every writer: no slot is held twice."""
        if self.held is not None:
            raise RuntimeError("a read() or apply() is in progress here: one at a time")
        self.held = slot

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """Held while pull() writes the live tensors (takes the lock): apply() must not copy
        into them meanwhile."""
        with self.lock:
            self.held = -1
        try:
            yield
        finally:
            with self.lock:
                self.held = None

    def pin(self, slot: int, count: int = 1) -> None:
        """``count`` more readers of ``slot`` (forwards, a patch's copy)."""
        self.forwarding[slot] = self.forwarding.get(slot, 0) + count

    def unpin(self, slot: int) -> None:
        left = self.forwarding.get(slot, 0) - 1
        if left > 0:
            self.forwarding[slot] = left
        else:
            self.forwarding.pop(slot, None)

    def lend_due(self, newest: int, applied: int) -> bool:
        """Whether the newest version's slot should be handed back now: a lend was asked for
        past ``newest`` (the newest complete version) and that version was applied (``applied``)
        and nobody reads the slot."""
        slot = self.newest
        return (
            slot is not None
            and self.lend_for > newest
            and self.version[slot] <= applied
            and self.held != slot
            and not self.forwarding.get(slot)
        )

    def patch_source(self, slot: int, base: int, in_place: bool) -> tuple[int | None, str]:
        """The slot holding ``base`` whole, to copy into ``slot`` before changes are applied
        there (``in_place``: ``slot`` itself, the live tensors), pinned; or None and why there
        is none."""
        src = self.newest
        if not 0 <= slot < self.count:
            return None, f"slot {slot} does not exist"
        if in_place:
            if src != slot or self.version[slot] != base or self.dirty:
                held = "torn" if self.dirty else f"version {self.version[slot]}"
                return None, f"its live tensors hold {held}, not version {base} whole"
            self.pin(slot)
            return slot, ""
        if src is None or self.handed_back or self.version[src] != base:
            newest = -1 if src is None or self.handed_back else self.version[src]
            return None, f"it holds version {newest} whole, not {base}"
        if slot in (src, self.held) or self.forwarding.get(slot):
            return None, f"slot {slot} is in use"
        self.pin(src)
        return src, ""
