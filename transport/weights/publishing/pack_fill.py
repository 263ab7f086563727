"""When the publisher fills its pack at a publish: before the writes, or while they run when no
write reads it: :class:`PackFill`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from transport.weights.group.seqword import SeqWord
from transport.weights.publishing.delivery import Delivery
from transport.weights.publishing.members import PublisherMember, Waiting
from transport.weights.publishing.pack import Pack


class PackFill:
    """The part of :class:`WeightPublisher` that copies the trainer's small tensors into its
    pack (pack.py) at each publish. It owns whether this publish fills the pack after its writes
    began (``_filling_after``) and the members that wait for it meanwhile (``_parked``); the
    pack, the sequence word and the members are the publisher's, changed under its lock.

    Rules: the pack is filled before the writes unless every member takes the trainer's tensors
    as they are (``unpacked``: its connection copies in the kernel) and the publisher writes each
    itself (fanout ``"direct"``): then no write reads it, and it is filled while the writes run
    (on the engine's thread), then named for pull(). A member planned meanwhile that would write
    from the pack waits until it is filled (:meth:`_waits_for_pack`). Either way a late joiner's
    pull() sees the copies as changing while they are made, and never a version they do not
    hold.
    """

    fanout: str
    _pack: Pack
    _word: SeqWord
    _subs: dict[str, PublisherMember]
    _lock: threading.RLock

    if TYPE_CHECKING:

        def _resume(self, sub: PublisherMember) -> None: ...

    def _init_pack_fill(self) -> None:
        self._filling_after = False
        self._parked: list[PublisherMember] = []

    def _fill_after_writes(self) -> bool:
        """With the lock held: whether this publish fills the pack after its writes began."""
        self._filling_after = (
            bool(self._pack.names)
            and self.fanout == "direct"
            and all(sub.unpacked for sub in self._subs.values())
        )
        return self._filling_after

    def _fill_pack(self) -> None:
        """Copy the tensors into the pack (a late joiner's pull() sees them changing meanwhile)."""
        with self._word.filling():
            self._pack.fill()

    def _filled_after(self, version: int | None) -> None:
        """Fill the pack after the writes of ``version`` began (None: it did not begin), name it
        for pull(), and start the members that waited for the pack."""
        self._fill_pack()
        with self._lock:
            self._filling_after = False
            if version is not None:
                self._word.stamp(version)
            parked, self._parked = self._parked, []
            for sub in parked:
                self._resume(sub)

    def _waits_for_pack(
        self, sub: PublisherMember, version: int, handle: Delivery, via: str | None
    ) -> bool:
        """With the lock held: ``sub`` would write from the pack while it is being filled; it
        waits for ``version`` until then (True)."""
        if not self._filling_after or sub.unpacked:
            return False
        sub.waiting = Waiting(version, handle, via)
        self._parked.append(sub)
        return True
