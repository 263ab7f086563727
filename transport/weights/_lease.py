"""The publisher lease of a weight group: one publisher at a time.

A lease is a value in the store, ``transport/<namespace>/groups/<group>/lease`` (rank 0, and
a plain publisher) or ``.../lease/<rank>`` (the other ranks of a sharded trainer): the holder's
peer name and generation, its rank, the number of ranks (``world``) and the digest of the source
layout they share (empty for a plain publisher). Every publisher also writes ``.../ranks``, the
world, so that a subscriber knows how many ranks' parts make a version. A publisher takes it at
construction, with compare-and-set, and gives it back at close. A second publisher of the group
fails with GroupBusyError naming the holder, unless the holder is gone: its name has no record
any more, or a newer incarnation's, or its heartbeat stopped (a killed process keeps its record
until it restarts): silent past the *gone* bar of transport/liveness.py (10 heartbeat
intervals, at least 10 s), higher than the bar at which a peer is merely suspect, since a
takeover cannot be undone. Garbage in the lease's place is overwritten, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from transport.errors import GroupBusyError, PeerNotFoundError, StoreError, WireFormatError
from transport.liveness import GONE_BEATS, GONE_MIN_S, staleness
from transport.wire import unpack

if TYPE_CHECKING:
    from transport import Transport
    from transport.store import Store

log = logging.getLogger("transport.weights")

FREE = b""  # a lease given back


@dataclass(frozen=True)
class Lease:
    """Who publishes one rank of a group: the holder's name and generation, its rank of
    ``world`` and the digest of the source layout (empty: a plain publisher)."""

    name: str
    generation: int
    rank: int = 0
    world: int = 1
    layout: str = ""

    def encode(self) -> bytes:
        out: bytes = msgpack.packb(
            {
                "v": 2, "name": self.name, "gen": self.generation, "rank": self.rank,
                "world": self.world, "layout": self.layout,
            }  # fmt: skip
        )
        return out

    @classmethod
    def decode(cls, raw: bytes) -> Lease:
        m = unpack(raw, "publisher lease", 4096, max_str=256, max_array=0, max_map=8)
        if (
            not isinstance(m, dict)
            or set(m) != {"v", "name", "gen", "rank", "world", "layout"}
            or m["v"] != 2
            or not isinstance(m["name"], str)
            or not isinstance(m["layout"], str)
            or not all(_count(m[k]) for k in ("gen", "rank", "world"))
            or not m["rank"] < m["world"] <= MAX_WORLD
        ):
            raise WireFormatError(f"malformed publisher lease {str(m)[:80]}")
        return cls(m["name"], m["gen"], m["rank"], m["world"], m["layout"])

    def __str__(self) -> str:
        return f"{self.name} (generation {self.generation})"


class PublisherLease:
    """The lease of one group as one Transport holds or wants it (see the module docstring).

    It owns nothing but the key and what it wrote: :meth:`acquire` takes the lease or raises
    GroupBusyError, :meth:`release` gives it back only if it is still ours (a publisher that took
    over from us keeps it). Every call is a few store round trips, on the caller's thread.
    """

    def __init__(
        self, transport: Transport, group: str, rank: int = 0, world: int = 1, layout: str = ""
    ) -> None:
        self.transport = transport
        self.group = group
        self.key = lease_key(transport.namespace, group, rank)
        self.mine = Lease(transport.name, transport.generation, rank, world, layout)
        self.what = f"group {group!r}" + (f" rank {rank}" if world > 1 else "")
        self.held = False

    def acquire(self) -> None:
        """Take the lease (construction): GroupBusyError while a live publisher holds it. Then
        say how many ranks publish the group (``ranks``)."""
        self._claim(first=True)
        self.transport.store.set(ranks_key(self.transport.namespace, self.group),
                                 str(self.mine.world).encode())  # fmt: skip

    def _claim(self, first: bool) -> None:
        """Write our lease where the store has none, a free one, garbage or (``first`` only) the
        lease of a holder that is gone; GroupBusyError otherwise."""
        store, ours = self.transport.store, self.mine.encode()
        for _ in range(8):  # each turn loses only to another publisher's write
            raw = store.try_get(self.key)
            holder = None
            if raw is not None and raw != FREE:
                try:
                    holder = Lease.decode(raw)
                except WireFormatError as e:
                    log.warning(
                        "group %s: replacing a malformed publisher lease (%s)", self.group, e
                    )
            if holder == self.mine:
                self.held = True
                return
            if holder is not None and not first:
                self.held = False
                raise GroupBusyError(
                    f"{self.what}: this publisher lost its lease to {holder}, which "
                    "took over while this one was silent; close this publisher"
                )
            if holder is not None:
                why = self._alive(holder)
                if why:
                    raise GroupBusyError(
                        f"{self.what} already has a publisher: {holder}, {why}; one "
                        "publisher per group (and rank): close it (or let it end) first, or "
                        "publish to another group"
                    )
                log.warning("group %s: taking over the lease of %s, which is gone",
                            self.group, holder)  # fmt: skip
            if store.compare_set(self.key, raw, ours):
                if not first:
                    log.warning("group %s: the store had lost the publisher lease; wrote it back",
                                self.group)  # fmt: skip
                self.held = True
                return
        raise GroupBusyError(f"{self.what}: the publisher lease kept changing; try again")

    def _alive(self, holder: Lease) -> str:
        """Why ``holder`` counts as alive ("" if it is gone)."""
        return holder_alive(self.transport, holder)

    def ensure(self) -> None:
        """At each publish: write our lease back if the store lost it (a Redis restarted empty;
        subscribers take messages only from the holder); GroupBusyError if another publisher
        holds it now (it took over while this one was silent past the bar)."""
        if self.held:
            self._claim(first=False)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self.transport.store.compare_set(self.key, self.mine.encode(), FREE)
        except StoreError as e:  # the next publisher finds us gone by our record or heartbeat
            log.warning("group %s: could not give back the publisher lease: %s", self.group, e)


def holder_alive(transport: Transport, holder: Lease) -> str:
    """Why ``holder`` counts as alive ("" if it is gone: no record, a newer incarnation's, a
    garbage record, or a heartbeat silent past the *gone* bar)."""
    try:
        info = transport.wait_for_peer(holder.name, timeout=0.0)
    except PeerNotFoundError:
        return ""  # no record: it left
    except WireFormatError:
        return ""  # its record is garbage: nobody can reach it
    if info.generation != holder.generation:
        return ""  # restarted (a newer incarnation), or the record is of another
    if info.last_heartbeat is None or staleness(
        info.last_heartbeat,
        transport.heartbeat_interval,
        beats=GONE_BEATS,
        floor=GONE_MIN_S,
    ):
        return ""
    return f"alive on {info.host} (pid {info.pid})"


#: the most ranks of one sharded trainer
MAX_WORLD = 4096


def lease_key(namespace: str, group: str, rank: int = 0) -> str:
    base = f"transport/{namespace}/groups/{group}/lease"
    return base if rank == 0 else f"{base}/{rank}"


def ranks_key(namespace: str, group: str) -> str:
    return f"transport/{namespace}/groups/{group}/ranks"


def group_world(store: Store, namespace: str, group: str) -> int:
    """How many ranks publish ``group`` (1 unless a sharded trainer said otherwise; garbage: 1)."""
    raw = store.try_get(ranks_key(namespace, group))
    try:
        world = int(raw) if raw is not None else 1
    except ValueError:
        return 1
    return world if 1 <= world <= MAX_WORLD else 1


def current_leases(store: Store, namespace: str, group: str) -> tuple[int, dict[int, Lease]]:
    """The world of ``group`` and the lease of each of its ranks that has one now."""
    world, rank, out = group_world(store, namespace, group), 0, {}
    while rank < world:  # a lease may say more ranks than the key (written just after it)
        lease = current_lease(store, namespace, group, rank)
        if lease is not None and lease.rank == rank:
            out[rank] = lease
            world = max(world, lease.world)
        rank += 1
    return world, out


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def current_lease(store: Store, namespace: str, group: str, rank: int = 0) -> Lease | None:
    """The lease of ``group``'s ``rank`` as the store has it now (None: free, absent or
    malformed)."""
    raw = store.try_get(lease_key(namespace, group, rank))
    if raw is None or raw == FREE:
        return None
    try:
        return Lease.decode(raw)
    except WireFormatError:
        return None
