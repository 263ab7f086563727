"""Which ranks of a sharded trainer have landed their parts of a version at one subscriber."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class RankParts:
    """A subscriber's record of a sharded trainer's versions in flight: per (version, slot) the
    ranks whose ``ver`` came, and ``settled``, the newest version it is done with (complete, or
    given up). It owns only that record; its subscriber calls it under its own lock. Rules: a
    version completes only once every rank of the trainer's ``world`` landed its parts into the
    same slot; a version at or below ``settled`` never completes; at most ``2 * slots`` versions
    are tracked (a rank that runs ahead cannot grow the record)."""

    def __init__(self, group: str, slots: int) -> None:
        self.group, self.slots = group, slots
        self.parts: dict[tuple[int, int], set[int]] = {}
        self.settled = -1

    def landed(self, peer: str, rank: int | None, world: int, version: int, slot: int) -> bool:
        """Whether every rank's parts of ``version`` in ``slot`` have landed with this ``ver``
        of ``peer`` (rank ``rank`` of ``world``; always, for a plain publisher or a relay)."""
        if world == 1:
            return True
        if rank is None:
            log.warning(
                "group %s: ignoring version %d from %s: it publishes no rank of the group's %d",
                self.group,
                version,
                peer,
                world,
            )
            return False
        if version <= self.settled:
            return False  # done with: complete already, or given up
        got = self.parts.setdefault((version, slot), set())
        got.add(rank)
        if len(got) < world:
            while len(self.parts) > 2 * self.slots:
                del self.parts[min(self.parts)]
            return False
        del self.parts[(version, slot)]
        return True

    def give_up(self, version: int, why: str, world: int) -> None:
        """``version`` will not complete here: its parts are dropped (the version before it
        stays the newest); the ranks learn it from the next credit."""
        if version <= self.settled:
            return
        self.settled = version
        for key in [k for k in self.parts if k[0] <= version]:
            ranks = sorted(self.parts.pop(key))
            missing = sorted(set(range(world)) - set(ranks))
            log.warning(
                "group %s: version %d given up (%s): the parts of rank(s) %s never landed",
                self.group,
                version,
                why,
                missing,
            )
