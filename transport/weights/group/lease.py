"""The publisher lease of a weight group: one publisher at a time.

A lease is a value in the store, ``transport/<namespace>/groups/<group>/lease`` (rank 0, and
a plain publisher) or ``.../lease/<rank>`` (the other ranks of a sharded trainer): the holder's
peer name and generation, its rank, the number of ranks (``world``) and the digest of the source
layout they share (empty for a plain publisher). Rank 0 also writes ``.../ranks``, the world, so
that a subscriber knows how many ranks' parts make a version. A publisher takes its lease at
construction, with compare-and-set, and gives it back at close. A second publisher of the group
fails with GroupBusyError naming the holder, unless the holder is gone: its name has no record
any more, or a newer incarnation's, or its heartbeat stopped (a killed process keeps its record
until it restarts): silent past the *gone* bar of transport/peers/liveness.py (10 heartbeat
intervals, at least 10 s), higher than the bar at which a peer is merely suspect, since a
takeover cannot be undone. Garbage in the lease's place is overwritten, with a warning.

Trust (DESIGN.md): leases and ``ranks`` decide who takes part and how many ranks' parts make a
version, so they are signed values (``transport/security/signed.py``): a lease counts only if its holder
signed it (the signature's writer and generation are the lease's name and generation) under the
key of its rank; ``ranks`` only if rank 0's current holder signed it. Anything else (malformed,
unsigned in a namespace with a secret, another writer's) is ignored and logged, and a publisher
overwrites it in its own place. A store writer without the secret can still delete a lease, free
it (:data:`FREE` is plain, like a deletion) or put back an older lease of the same key (a
replay). So the readers that act on leases (:class:`GroupLeases`: a subscriber's senders and its
world, a rank's check of the other ranks) also check each lease that changed against the
holder's live record, and ignore one whose holder has no record any more or a record of another
generation; and a holder whose lease was replaced by one of a holder that is gone takes it back
at its next publish (:meth:`PublisherLease.ensure`). What remains: a deleted or freed lease lets
a second publisher start while the first is alive (the first then stops with GroupBusyError at
its next publish); a lease put back that a live incarnation once held for the same rank (the
same process published the group before, with another world or rank) is believed as if it
held it now.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import torch

from transport import (
    GroupBusyError,
    PeerNotFoundError,
    Store,
    StoreError,
    TransportError,
    WireFormatError,
)
from transport.contract import GONE_BEATS, GONE_MIN_S, SignedStore, is_count, staleness, unpack
from transport.weights.group.group_directory import reader
from transport.weights.group.region_names import marked_rank, rank_mark
from transport.weights.group.withdraw import withdraw

if TYPE_CHECKING:
    from transport import Transport

log = logging.getLogger(__name__)

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
                "v": 2,
                "name": self.name,
                "gen": self.generation,
                "rank": self.rank,
                "world": self.world,
                "layout": self.layout,
            }
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
            or not all(is_count(m[k]) for k in ("gen", "rank", "world"))
            or not m["rank"] < m["world"] <= MAX_WORLD
        ):
            raise WireFormatError(f"malformed publisher lease {str(m)[:80]}")
        return cls(m["name"], m["gen"], m["rank"], m["world"], m["layout"])

    def __str__(self) -> str:
        return f"{self.name} (generation {self.generation})"


def decode_lease(signed: SignedStore, key: str, raw: bytes, rank: int) -> Lease:
    """The lease stored under ``key`` (of ``rank``): WireFormatError (SignatureError with a
    secret) unless its holder signed it for that rank."""
    value = signed.decode(key, raw, f"the publisher lease {key}")
    lease = Lease.decode(value.body)
    if (value.writer, value.generation) != (lease.name, lease.generation):
        raise WireFormatError(
            f"malformed publisher lease {key}: it names {lease}, but "
            f"{value.writer} (generation {value.generation}) signed it"
        )
    if lease.rank != rank:
        raise WireFormatError(f"malformed publisher lease {key}: it is of rank {lease.rank}")
    return lease


class PublisherLease:
    """The lease of one group (and rank) as one Transport holds or wants it (see the module
    docstring).

    It owns nothing but the key and what it wrote: :meth:`acquire` takes the lease or raises
    GroupBusyError, :meth:`release` gives it back only if it is still ours (a publisher that took
    over from us keeps it). Every call is a few store round trips, on the caller's thread.
    """

    def __init__(
        self, transport: Transport, group: str, rank: int = 0, world: int = 1, layout: str = ""
    ) -> None:
        self.transport = transport
        self.group = group
        self.signed = transport.core.signed
        self.key = lease_key(transport.namespace, group, rank)
        self._ranks_key = ranks_key(transport.namespace, group)
        self.mine = Lease(transport.name, transport.generation, rank, world, layout)
        self._ours = self.signed.encode(self.key, self.mine.encode())
        self.what = f"group {group!r}" + (f" rank {rank}" if world > 1 else "")
        self.held = False
        self._mark = rank_mark(group, rank, world)

    def acquire(self) -> None:
        """Take the lease (construction): GroupBusyError while a live publisher holds it. Rank 0
        then says how many ranks publish the group (``ranks``), and a rank of a sharded trainer
        says in its own record which rank of how many it is (``regions.rank_mark``)."""
        if self.mine.world > 1 and self._mark not in self.transport.regions():
            # before the lease: a subscriber that reads the lease finds the mark in the record
            self.transport.expose(self._mark, torch.zeros(1, dtype=torch.uint8), access="r")
        self._claim(first=True)
        if self.mine.rank == 0:
            self.signed.set(self._ranks_key, str(self.mine.world).encode())

    def _claim(self, first: bool) -> bool:
        """Write our lease where the store has none, a free one, one that is not valid, or the
        lease of a holder that is gone (at ``first``, a takeover; later, a lease put back, or a
        holder that took over and died since); GroupBusyError while another holder is alive.
        True if the store held no lease (none, or a free one) and ours was written."""
        store = self.transport.store
        for _ in range(8):  # each turn loses only to another publisher's write
            raw = store.try_get(self.key)
            holder = None
            if raw is not None and raw != FREE:
                try:
                    holder = decode_lease(self.signed, self.key, raw, self.mine.rank)
                except WireFormatError as e:
                    log.warning(
                        "group %s: replacing a malformed publisher lease (%s)", self.group, e
                    )
            if holder == self.mine:
                self.held = True
                return False
            if (
                not first
                and holder is not None
                and (holder.name, holder.generation) == (self.mine.name, self.mine.generation)
            ):
                # held by us, yet not this lease: an earlier publisher's of this Transport put
                # back (or, without a secret, a forgery): ours to overwrite
                log.warning(
                    "group %s: replacing a lease of this incarnation that is not this "
                    "publisher's (%s; a value put back?)",
                    self.group,
                    holder,
                )
                holder = None
            if holder is not None:
                why = self._alive(holder)
                if why and not first:
                    self.held = False
                    raise GroupBusyError(
                        f"{self.what}: this publisher lost its lease to {holder}, which "
                        "took over while this one was silent; close this publisher"
                    )
                if why:
                    raise GroupBusyError(
                        f"{self.what} already has a publisher: {holder}, {why}; one "
                        "publisher per group (and rank): close it (or let it end) first, or "
                        "publish to another group"
                    )
                if first:
                    log.warning(
                        "group %s: taking over the lease of %s, which is gone", self.group, holder
                    )
                else:
                    log.warning(
                        "group %s: the store holds the lease of %s, which is gone, in place of "
                        "ours (a value put back?); taking it back",
                        self.group,
                        holder,
                    )
            if store.compare_set(self.key, raw, self._ours):
                missing = raw is None or raw == FREE
                if not first and missing:
                    log.warning(
                        "group %s: the store had lost the publisher lease; wrote it back",
                        self.group,
                    )
                self.held = True
                return missing
        raise GroupBusyError(f"{self.what}: the publisher lease kept changing; try again")

    def _alive(self, holder: Lease) -> str:
        """Why ``holder`` counts as alive ("" if it is gone)."""
        return holder_alive(self.transport, holder)

    def keys_read(self) -> list[str]:
        """The keys :meth:`ensure` reads (a publisher reads them ahead with its other keys)."""
        if not self.held:
            return []
        return [self.key, self._ranks_key] if self.mine.rank == 0 else [self.key]

    def ensure(self) -> bool:
        """At each publish: write our lease back if the store lost it (a Redis restarted empty;
        subscribers take messages only from the holder) or holds something else that does not
        count (garbage, a forgery, the lease of a holder that is gone), and rank 0's ``ranks``
        likewise; GroupBusyError if another publisher holds it now (it took over while this one
        was silent past the bar). True if the store had lost it (none there): the store lost
        the group's other values too, whatever its counters show now."""
        if not self.held:
            return False
        lost = self._claim(first=False)
        if self.mine.rank == 0:
            # put back over exactly what was read (compare_set): a count that a publisher which
            # took the lease over since wrote in between stays (and we learn of the takeover at
            # our next publish), as does our own written again by a concurrent ensure
            body = str(self.mine.world).encode()
            raw = self.transport.store.try_get(self._ranks_key)
            if raw != self.signed.encode(self._ranks_key, body) and self.signed.compare_set(
                self._ranks_key, raw, body
            ):
                log.warning(
                    "group %s: the store lost the count of ranks %s (or held one that "
                    "is not ours); wrote it back",
                    self.group,
                    self._ranks_key,
                )
        return lost

    def release(self) -> None:
        if self.mine.world > 1:
            withdraw(self.transport, [self._mark], f"{self.what} (its rank's mark)")
        if not self.held:
            return
        self.held = False
        try:
            self.transport.store.compare_set(self.key, self._ours, FREE)
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

_WORLD = re.compile(rb"[1-9][0-9]{0,3}")


def lease_key(namespace: str, group: str, rank: int = 0) -> str:
    base = f"transport/{namespace}/groups/{group}/lease"
    return base if rank == 0 else f"{base}/{rank}"


def ranks_key(namespace: str, group: str) -> str:
    return f"transport/{namespace}/groups/{group}/ranks"


@dataclass(frozen=True)
class Publishers:
    """The publishers of a group as a member reads them: the lease of each rank that has a valid
    one (``leases``), what ``ranks`` says when rank 0's holder wrote it (None otherwise), and
    ``world``, how many ranks' parts make a version: the most that ``ranks`` or any of those
    leases says (1 when none says anything)."""

    world: int
    ranks: int | None
    leases: dict[int, Lease]


class GroupLeases:
    """The publisher leases of one group as one member reads them, for acting on them: who the
    publishers are, of which rank, and how many ranks publish (:meth:`read`).

    A lease counts if its holder signed it for its rank (``decode_lease``) and, with ``live``,
    if the holder's record is of the lease's generation: a lease put back from an older
    incarnation (or of a holder that left) is ignored. The record is read only for a lease that
    differs from the one this reader last found live at that rank, so a steady group costs no
    record reads. It owns that memory and the keys already warned about (each bad value is
    logged once per key); thread-safe. StoreError passes through.
    """

    def __init__(self, transport: Transport, group: str) -> None:
        self.transport = transport
        self.group = group
        self.signed = transport.core.signed
        self._namespace = transport.namespace
        self._lock = threading.Lock()
        self._live: dict[int, Lease] = {}
        self._warned: dict[str, bytes] = {}

    def read(self, at_least: int = 1, live: bool = True, marks: bool = False) -> Publishers:
        """The group's publishers now, reading the leases of at least ``at_least`` ranks (a
        rank knows its world even when the store says nothing of it), up to the world that
        rank 0's lease, ``ranks`` or any lease read says; while rank 0's lease does not count,
        also of the rank after each one whose key holds something (a lease that does not count
        must not hide the ranks after it). With ``marks`` (a subscriber, which completes a
        version once ``world`` ranks' parts landed), each holder's own record must say the
        same rank (``regions.rank_mark``; a plain publisher's says none), and ``world`` is
        at least what any of them says: the store's values alone never lower it."""
        first, held = self._lease(0, live)
        probe = first is None
        ranks = self._ranks(first)
        world = max(at_least, ranks or 1)
        leases: dict[int, Lease] = {} if first is None else {0: first}
        if first is not None:
            world = max(world, first.world)
        rank = 1
        while rank < MAX_WORLD and (rank < world or (probe and held)):
            lease, held = self._lease(rank, live)
            if lease is not None:
                leases[rank] = lease
                world = max(world, lease.world)
            rank += 1
        said = [ranks or 1, *(x.world for x in leases.values())]
        if marks:
            leases, marked = self._marked(leases)
            said.append(marked)
        return Publishers(max(said), ranks, leases)

    def _marked(self, leases: dict[int, Lease]) -> tuple[dict[int, Lease], int]:
        """The leases whose holder's record marks the lease's rank (or none, for a plain
        publisher's), and the largest world a mark says (1 if none). A holder whose record
        cannot be read, or says otherwise, is not a publisher for now (logged)."""
        kept, world = {}, 1
        for rank, lease in leases.items():
            try:
                view = self.transport.core.peer(lease.name)
                mark = marked_rank(view.regions, self.group)
                if view.generation != lease.generation or (mark is None and lease.world > 1):
                    # what the connection knows may predate the lease (a rank that joined
                    # this group after we connected to it, a restart): read its record afresh
                    view = self.transport.core.peer(lease.name, refresh=True)
                    mark = marked_rank(view.regions, self.group)
            except TransportError as e:
                log.info("group %s: cannot read the record of %s: %s", self.group, lease, e)
                continue
            says = mark or (0, 1)
            if (
                view.generation != lease.generation
                or says[0] != rank
                or (mark is None and lease.world > 1)
            ):
                self._warn(
                    f"mark/{rank}",
                    f"{lease}: {view.generation} {mark}".encode(),
                    f"the lease of rank {rank} ({lease}): its holder's record says "
                    + (f"rank {says[0]} of {says[1]}" if mark else "no rank of a sharded trainer"),
                )
                continue
            kept[rank] = lease
            world = max(world, says[1])
        return kept, world

    def _ranks(self, first: Lease | None) -> int | None:
        key = ranks_key(self._namespace, self.group)
        raw = self.signed.store.try_get(key)
        if raw is None or first is None:
            return None
        try:
            value = self.signed.decode(key, raw, f"the count of ranks {key}")
            if (value.writer, value.generation) != (first.name, first.generation):
                raise WireFormatError(
                    f"the count of ranks {key} was written by {value.writer} (generation "
                    f"{value.generation}), not by rank 0's publisher {first}"
                )
            if not _WORLD.fullmatch(value.body) or int(value.body) > MAX_WORLD:
                raise WireFormatError(f"the count of ranks {key} is {value.body[:20]!r}")
        except WireFormatError as e:
            self._warn(key, raw, str(e))
            return None
        return int(value.body)

    def _lease(self, rank: int, live: bool) -> tuple[Lease | None, bool]:
        """The lease of ``rank`` if it counts, and whether its key holds anything (a free lease
        does not)."""
        key = lease_key(self._namespace, self.group, rank)
        raw = self.signed.store.try_get(key)
        if raw is None or raw == FREE:
            return None, False
        try:
            lease = decode_lease(self.signed, key, raw, rank)
        except WireFormatError as e:
            self._warn(key, raw, str(e))
            return None, True
        if not live:
            return lease, True
        with self._lock:
            if self._live.get(rank) == lease:
                return lease, True
        why = self._stale(lease)
        if why:
            self._warn(key, raw, f"the lease of {lease}: {why}")
            return None, True
        with self._lock:
            self._live[rank] = lease
        return lease, True

    def _stale(self, lease: Lease) -> str:
        """Why ``lease`` is not its holder's live incarnation's ("" if it is)."""
        try:
            info = self.transport.wait_for_peer(lease.name, timeout=0.0)
        except PeerNotFoundError:
            return f"{lease.name} has no record (it left)"
        except WireFormatError as e:
            return f"the record of {lease.name} is not valid ({e})"
        if info.generation != lease.generation:
            return (
                f"{lease.name} is now generation {info.generation} (an older incarnation's "
                "lease, put back?)"
            )
        return ""

    def _warn(self, key: str, raw: bytes, why: str) -> None:
        with self._lock:
            if self._warned.get(key) == raw:
                return
            self._warned[key] = raw
        log.warning("group %s: ignoring %s", self.group, why)


def current_lease(
    store: SignedStore | Store, namespace: str, group: str, rank: int = 0
) -> Lease | None:
    """The lease of ``group``'s ``rank`` as the store has it now, if its holder signed it (None:
    free, absent or not valid). From a bare :class:`Store` (tests, tools) the MAC is not
    checked (``directory.reader``)."""
    signed = reader(store)
    key = lease_key(namespace, group, rank)
    raw = signed.store.try_get(key)
    if raw is None or raw == FREE:
        return None
    try:
        return decode_lease(signed, key, raw, rank)
    except WireFormatError:
        return None
