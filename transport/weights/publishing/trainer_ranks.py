"""A sharded trainer's ranks as one rank sees them through the store: that they agree on the
source layout, which version each began last, and why the others may lack a version's parts."""

from __future__ import annotations

import re

from transport import LayoutError, Transport, TransportError
from transport.weights.group.group_directory import GroupDirectory
from transport.weights.group.lease import GroupLeases, Lease, holder_alive
from transport.weights.peer_watch import PeerWatch

_VERSION = re.compile(rb"-1|0|[1-9][0-9]{0,18}")


class TrainerRanks:
    """Owns rank ``rank``'s view of the other ranks of a ``world``-rank trainer: their leases
    (read from the store) and the version each says it began last (``published/<rank>``,
    signed by the rank's holder). Rules: a rank publishes only while every other rank's lease
    that counts (signed by its live holder) declares the same world and source layout
    (``digest``); what it reads of another rank only words a report, never decides a write."""

    def __init__(
        self, transport: Transport, directory: GroupDirectory, rank: int, world: int, digest: str
    ) -> None:
        self.transport, self.rank, self.world, self.digest = transport, rank, world, digest
        self._dir = directory
        self._leases = GroupLeases(transport, directory.group)
        self._watch = PeerWatch(transport)

    def check(self) -> None:
        """The other ranks' leases (those that count: signed by their live holders) must
        declare this world and source layout, and ``ranks`` (if rank 0 wrote it) this world;
        LayoutError names every rank that does not."""
        found = self._leases.read(at_least=self.world)
        problems = [
            f"rank {r} ({lease}) declares another source layout"
            + (f" of {lease.world} ranks" if lease.world != self.world else "")
            for r, lease in sorted(found.leases.items())
            if r != self.rank and (lease.layout != self.digest or lease.world != self.world)
        ]
        if found.ranks is not None and found.ranks != self.world:
            problems.append(
                f"the group says {found.ranks} ranks publish it, this rank {self.world}"
            )
        if problems:
            raise LayoutError(
                problems
                + ["every rank must build the same SourceLayout (world, shapes, dtypes, slices)"]
            )

    def published(self, version: int) -> None:
        """Say in the store which version this rank began last (the other ranks name us by it;
        signed: only this rank's holder writes it)."""
        self.transport.core.signed.set(
            self._dir.prefix + f"published/{self.rank}", str(version).encode()
        )

    def newest_of(self, rank: int, lease: Lease) -> int:
        """The version rank ``rank`` (held by ``lease``) says it began last; -1 if none that
        its holder signed (an older value put back by a store writer only makes this report
        name an older version: it decides nothing)."""
        key = self._dir.prefix + f"published/{rank}"
        value = self.transport.core.signed.read(key, f"the version {key}")
        if value is None or (value.writer, value.generation) != (lease.name, lease.generation):
            return -1
        return int(value.body) if _VERSION.fullmatch(value.body) else -1

    def missing(self, version: int) -> str:
        """The other ranks, and why each may lack its parts of ``version`` (from the store: gone,
        never published it, or published it and its parts did not land; the subscriber's log
        says which ranks' parts it got)."""
        try:
            leases = self._leases.read(at_least=self.world, live=False).leases
            out = []
            for r in range(self.world):
                if r == self.rank:
                    continue
                lease = leases.get(r)
                if lease is None:
                    out.append(f"rank {r} has no publisher")
                    continue
                if not holder_alive(self.transport, lease):
                    out.append(f"rank {r} ({lease.name}) is gone")
                    continue
                newest = self.newest_of(r, lease)
                if newest < version:
                    out.append(
                        f"rank {r} ({lease.name}) has not published version {version} "
                        f"(its newest: {newest})"
                    )
                    continue
                suspect = self._watch.why(lease.name, lease.generation)
                out.append(
                    f"rank {r} ({lease.name}) began it, but its parts did not complete"
                    + (f" (suspect: {suspect})" if suspect else "")
                )
        except TransportError as e:
            return f"the other ranks could not be read: {e}"
        return "other ranks: " + "; ".join(out) if out else "this rank is the only one"
