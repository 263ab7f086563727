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
    live tensors may be torn). For delta versions: the version being written into each slot
    (``writing``), the slots whose bytes no longer are the version they held (``torn``: a
    write into them was given up, or another began), and the slots being made a copy of the
    newest version (``priming``: a delta then applies onto them).

    Rules: the subscriber's lock guards it, every call but :meth:`pulling` is made under that
    lock (which ``lock`` is). A writer takes
    only :meth:`free` slots: never the newest complete version's (until handed back), the held
    one, one a forward or a copy reads, or one being primed; one read or apply at a time. A
    slot is primed only when it has just become free (so no writer was offered it since) and
    no version is being written into it.
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
        self.writing: dict[int, int] = {}  # slot -> the version a publisher began there
        self.torn: set[int] = set()
        self.priming: set[int] = set()

    def landed(self, slot: int, version: int) -> None:
        """``version`` is complete in ``slot``: the newest."""
        self.version[slot] = version
        self.newest = slot
        self.handed_back = False
        self.dirty = False
        self.torn.discard(slot)
        self.writing.pop(slot, None)

    def refuses(self, slot: int, version: int) -> str:
        """Why ``version``'s notification for ``slot`` completes nothing ("" when it does): its
        publisher gave it up (whose next credit may already hand the slot out), or a newer
        version began in the slot since (the late end of a write given up here: the slot holds
        neither whole; found by transport chaos, a put that crossed a cut link completing after
        the next version's relay had begun writing the slot)."""
        if self.aborted.get(slot) == version:
            return "its publisher gave it up"
        later = self.writing.get(slot, version)
        if later > version:
            return f"version {later} began there since"
        return ""

    def begin(self, slot: int, version: int) -> None:
        """A publisher began writing ``version`` into ``slot``: a slot where another version was
        begun and never landed is torn."""
        if 0 <= slot < self.count:
            if self.writing.get(slot, version) != version:
                self.torn.add(slot)
            self.writing[slot] = version

    def abort(self, slot: int, version: int) -> None:
        """The write of ``version`` into ``slot`` was given up: what the slot held is torn."""
        self.aborted[slot] = version
        if self.writing.get(slot) == version:
            del self.writing[slot]
            self.torn.add(slot)

    def holds(self, slot: int) -> int:
        """The version ``slot`` holds whole (-1: none, or torn)."""
        return -1 if slot in self.torn else self.version[slot]

    def free(self) -> list[int]:
        """The slots a publisher may write. Never the newest version's, except the only slot
        once that version was applied (then it is no longer readable)."""
        newest = None if self.handed_back else self.newest
        busy = {self.held, newest} | {k for k, n in self.forwarding.items() if n} | self.priming
        return [k for k in range(self.count) if k not in busy]

    def to_prime(self, before: list[int]) -> tuple[int, list[int]] | None:
        """The newest version's slot and the slots to make copies of it: those free now that
        were not in ``before`` (the free slots before a change of state) and hold another
        version; marked ``priming`` (and the source pinned) until :meth:`primed`. None: none."""
        src = self.newest
        if src is None or self.handed_back or src in self.torn:
            return None
        want = self.version[src]
        # never one a version is being written into: a slot that a forward of the arriving
        # version pinned becomes free again when the forward ends, before the version lands
        # here, and a copy then would write the newest version over the arriving one
        dst = [
            k
            for k in self.free()
            if k not in before and k not in self.writing and self.holds(k) != want
        ]
        if not dst:
            return None
        self.priming.update(dst)
        self.pin(src)
        return src, dst

    def primed(self, src: int, dst: list[int], ok: bool) -> None:
        """The copies of :meth:`to_prime` were made (``ok``) or not (then the slots hold none)."""
        for k in dst:
            self.priming.discard(k)
            self.writing.pop(k, None)
            if ok:
                self.version[k] = self.version[src]
                self.torn.discard(k)
            else:
                self.torn.add(k)
        self.unpin(src)

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

    def pin_forwards(
        self, version: int, newest: int, arriving: int | None, count: int
    ) -> tuple[int | None, str | None]:
        """Where ``count`` forwards of ``version`` read from, pinned: the newest version's slot
        if ``version`` is it (``newest``), else the slot it is ``arriving`` in; (None, "")
        while nothing of it is here, (None, why) when it never will be."""
        if newest > version:
            return None, f"version {newest} arrived here before {version} was forwarded"
        if newest == version and self.handed_back:
            return None, f"its copy of version {version} was handed back to the publisher"
        src = self.newest if newest == version else arriving
        if src is None:
            return None, ""  # nothing of it here yet
        self.pin(src, count)
        return src, None

    def unpin(self, slot: int) -> None:
        left = self.forwarding.get(slot, 0) - 1
        if left > 0:
            self.forwarding[slot] = left
        else:
            self.forwarding.pop(slot, None)

    def hand_back_if_due(self, newest: int, applied: int) -> None:
        """Hand the newest version's slot back (``handed_back``) if that is due now: a lend was
        asked for past ``newest`` (the newest complete version), that version was applied
        (``applied``) and nobody reads the slot."""
        slot = self.newest
        if (
            slot is not None
            and self.lend_for > newest
            and self.version[slot] <= applied
            and self.held != slot
            and not self.forwarding.get(slot)
        ):
            self.handed_back = True

    def patch_target(
        self, slot: int, version: int, base: int, in_place: bool, single: bool
    ) -> tuple[str, int | None]:
        """Whether the changes that make ``version`` out of ``base`` apply onto ``slot``, which
        must hold ``base`` whole and be written with ``version`` only: ("", None) if they do;
        ("", source) if ``slot`` is first made a copy of slot ``source`` (pinned), the newest
        version's, which is ``base`` (``single``: one publisher writes the version, so nobody
        else writes ``slot`` meanwhile); else (why not, None)."""
        if not 0 <= slot < self.count:
            return f"slot {slot} does not exist", None
        held = "torn" if slot in self.torn or (in_place and self.dirty) else self.version[slot]
        if in_place:
            if self.newest != slot or held != base:
                return f"its live tensors hold version {held}, not version {base} whole", None
            return "", None
        # forwards pinned on ``slot`` are this version's (pinned as it began landing there, a
        # publisher writes no slot an older version's forwards read): they read it once complete
        newest = None if self.handed_back else self.newest
        if slot in (newest, self.held) or slot in self.priming:
            return f"slot {slot} is in use", None
        if self.writing.get(slot, version) != version:
            return f"slot {slot} is being written with version {self.writing[slot]}", None
        if held == base:
            return "", None
        src = self.newest
        if single and src is not None and not self.handed_back and self.holds(src) == base:
            self.pin(src)
            return "", src
        return f"slot {slot} holds version {held}, not {base} whole", None
