"""What a publisher keeps of each subscriber incarnation it serves: :class:`Member` (what both
publishers keep), :class:`PublisherMember` and :class:`RankMember` (what each keeps besides),
and the typed states they hold (a version waiting for a slot, a fenced slot, an acknowledged
write, changes in flight)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transport import Batch
from transport.weights.group.group_directory import GroupEntry
from transport.weights.group.segments import SegmentBatch
from transport.weights.publishing.delivery import Delivery
from transport.weights.slot_credits import SlotCredits

if TYPE_CHECKING:
    from transport.weights.publishing.write_plan import SlotWrites


@dataclass(frozen=True)
class PatchInFlight:
    """A version's changes (``nbytes``) written into a subscriber's inbox for ``slot``, waiting
    for its ``patched``."""

    version: int
    slot: int
    handle: Delivery
    nbytes: int


@dataclass(frozen=True)
class Retired:
    """A member incarnation the roster no longer serves, and why: it left, a newer incarnation
    of its name replaced it, or (``lost``) its peer went away."""

    member: Member
    why: str
    lost: bool


def replaced_why(old: Member, generation: int) -> str:
    """Why the member ``old`` was planned again, as incarnation ``generation``."""
    if generation != old.generation:
        return f"a newer incarnation of it (generation {generation}) joined"
    if old.error:
        return f"it is planned again ({old.error})"
    return "it joined again with another group entry"


@dataclass(frozen=True)
class Waiting:
    """A version waiting for a slot of a member: its handle, and the relay to write it (None:
    the publisher)."""

    version: int
    handle: Delivery
    via: str | None = None


@dataclass(frozen=True)
class Fence:
    """A slot whose write of version ``version`` may still be landing: nobody else writes it
    until that write is known to have drained. ``relay``: the relay that was cut off while
    writing it (drained once it reports on the member, or gone); None: the publisher's own
    write, which ended at its deadline with its bytes possibly still on the way (a transfer
    given up is not withdrawn from the connection), or which an earlier plan of the same
    incarnation still had in flight (drained once that write ends, or once a later write of
    ours to the member landed: one connection delivers in order)."""

    relay: str | None
    version: int


@dataclass(frozen=True)
class Acked:
    """A sharded rank's writes of ``version`` into ``slot`` all landed; the rank waits to hear
    that the subscriber completed it (from every rank)."""

    version: int
    slot: int
    handle: Delivery


class Member:
    """The publisher's view of one subscriber incarnation, what both publishers keep: its
    entry, what went wrong when it was planned (``error``: it is planned again at the next
    publish), since when its group entry is missing from a store that lost the group
    (``vanished``), its free slots (``credits``), its delta inbox, the changes in flight, the
    slot being written, the version waiting for a slot, and whether it is still served. Each
    publisher keeps the rest in its own subclass (:class:`PublisherMember`, :class:`RankMember`).
    The publisher changes it under its own lock only."""

    def __init__(self, name: str, entry: GroupEntry) -> None:
        self.name = name
        self.entry = entry  # as its group entry said
        self.generation, self.mode, self.slots = entry.generation, entry.mode, entry.slots
        self.instance = entry.instance  # which subscriber of that incarnation
        self.error = ""
        # ``error`` may pass by itself (no record or connection yet: a store that restarted
        # empty, a peer still starting): planned again while a version waits for it
        self.transient = False
        self.vanished: float | None = None  # monotonic time its entry was found missing
        self.asked = time.monotonic()  # when we last said hello (asked for free slots)
        # what it credited (weights/slot_credits.py): in place, its one slot, always
        self.credits = SlotCredits(range(self.slots) if self.mode == "inplace" else ())
        self.inbox = 0  # bytes of its delta inbox (0: it takes versions whole only)
        self.patch: PatchInFlight | None = None  # changes written, waiting for ``patched``
        self.started = 0.0  # when the write of ``busy`` began
        self.busy: int | None = None  # slot being written
        self.writing = -1  # the version being written into it
        self.waiting: Waiting | None = None  # a version waiting for a credit
        self.relay: str | None = None  # the relay writing ``busy``, which only it can give back
        # no longer served (left, replaced by a newer incarnation, lost): what completes for it
        # later is settled, and nothing more is sent to its name on its account
        self.retired = False

    def take_patch(self, version: int, slot: int | None = None) -> PatchInFlight | None:
        """The changes in flight that a ``patched`` (or their put's end) of ``version`` in
        ``slot`` (None: any) answers, no longer in flight; None if it answers none."""
        p = self.patch
        if p is None or p.version != version or (slot is not None and p.slot != slot):
            return None
        self.patch = None
        return p

    def let_go(self) -> list[Delivery]:
        """The handles of the versions it holds (waiting for a slot, its changes waiting for
        their answer, and what the subclass holds), no longer held."""
        held = [self.waiting.handle if self.waiting is not None else None]
        held.append(self.patch.handle if self.patch is not None else None)
        self.waiting = self.patch = None
        return [h for h in held if h is not None]


class PublisherMember(Member):
    """A subscriber as :class:`WeightPublisher` serves it: the names it takes and their
    ``batches`` per slot (from the trainer's tensors themselves where ``unpacked``), whether it
    may relay, the newest version that landed there, the relay
    writing it and that write's handle, the slots fenced off for a relay that was cut off while
    writing them, and the segments of a version in flight."""

    def __init__(self, name: str, entry: GroupEntry) -> None:
        super().__init__(name, entry)
        self.can_relay = entry.relay and entry.mode == "staging"
        self.names: frozenset[str] = frozenset()
        self.batches: list[Batch] = []
        self.unpacked = False  # its batches write the trainer's tensors, not the pack's copies
        self.completed = -1  # the newest version that landed there
        self.relay_handle: Delivery | None = None
        self.fenced: dict[int, Fence] = {}  # by slot
        self.lend_asked = -1  # the newest version it was asked to lend a slot for
        self.segments: dict[int, list[SegmentBatch]] = {}  # by slot

    def free_slot(self, direct: bool = False) -> int | None:
        """A slot the publisher may write now: credited, neither being written nor fenced. A
        slot fenced for our own write that may still be landing is fenced for relays only
        (``direct``: we write it ourselves, over the connection that carries those bytes, so
        ours land after them)."""
        busy = {self.busy} if self.busy is not None else set()
        fenced = {s for s, f in self.fenced.items() if f.relay is not None or not direct}
        free = self.credits.free(but=busy | fenced)
        return free[0] if free else None

    def unfence(self, relay: str | None, version: int | None = None) -> None:
        """``relay`` reported on this subscriber (on ``version`` or a later one: its writes here
        have drained) or is gone (``version`` None): the slots fenced for it are free again.
        ``relay`` None: the publisher's own writes up to ``version`` have drained."""
        for slot, fence in list(self.fenced.items()):
            if fence.relay == relay and (version is None or version >= fence.version):
                del self.fenced[slot]

    def no_slot(self, version: int) -> str:
        """Why ``version`` found no slot free here within its deadline."""
        if self.error:
            return self.error
        if not self.fenced:
            return f"no free slot within the deadline of version {version} (a slow apply?)"
        fences = sorted(self.fenced.values(), key=lambda f: (f.relay or "", f.version))
        why = "; ".join(
            f"relay {f.relay} was cut off while writing version {f.version} there, until it "
            "reports or is gone"
            if f.relay is not None
            else f"our write of version {f.version} there may still be landing, until a later "
            "write of ours lands"
            for f in fences
        )
        return (
            f"no free slot within the deadline of version {version}: {len(fences)} fenced "
            f"({why}); the other holds its newest version, which it had not applied (so it "
            "could not lend it)"
        )

    def let_go(self) -> list[Delivery]:
        held = super().let_go()
        if self.relay_handle is not None:
            held.append(self.relay_handle)
        self.relay_handle = None
        return held


class RankMember(Member):
    """A subscriber as one rank of a :class:`ShardedPublisher` serves it: what the rank writes
    per slot, its layout's key for the rank's delta copies, the newest version the subscriber
    completed and settled (its credits), the version this rank last began there, and the one
    whose completion it waits to hear of."""

    def __init__(self, name: str, entry: GroupEntry) -> None:
        super().__init__(name, entry)
        self.writes: list[SlotWrites] = []
        self.delta_key: object = None  # weights/delta/ranks.py
        self.newest = -1
        self.settled = -1
        self.last = -1
        self.acked: Acked | None = None

    def let_go(self) -> list[Delivery]:
        held = super().let_go()
        if self.acked is not None:
            held.append(self.acked.handle)
        self.acked = None
        return held
