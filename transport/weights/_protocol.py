"""What publishers and subscribers of a weight group say to each other, and where they meet.

Store keys, under ``transport/<namespace>/groups/<group>/``:

* ``epoch``: bumped by every join and leave, so a publisher notices changes with one read
* ``members/count``, ``members/<i>``, ``members/by-name/<name>``: every name that ever joined
* ``sub/<name>``: the subscriber's entry (generation, instance, mode, slots, relay) while it is in
  the group; the instance tells apart subscribers that one Transport makes one after another
* ``layout/<name>``: the destination layout the subscriber declared (for a sharded trainer)
* ``lease``, ``lease/<rank>``, ``ranks``: the publishers and their number (``_lease``)
* ``published/<rank>``: the version a rank of a sharded trainer began last

All but the counters and the membership index are signed values (``transport/signed.py``),
each written only by the one peer it is about (see :class:`GroupDirectory` and ``_lease``).
What a process that writes the store can still do:

* with a secret it lacks: delete any value, or put garbage or an unsigned value in its place
  (readers ignore it and log it: the same as a deletion): a subscriber is then left out of
  publishes until it writes its own entry, index place and layout back (it checks every
  second; a large layout is read back whole at most 64 KiB a second); a rank's lease or the
  rank count is written back by its holder at its next publish, and until then subscribers
  refuse that rank's messages (a version is given up, never torn); a deleted lease lets a
  second publisher start while the first is alive (the first stops at its next publish with
  GroupBusyError). Put back an older value of the same key: one of an older incarnation is
  refused (its generation is not the live record's) and its owner writes its own back; one of
  the same incarnation is the same value, unless that Transport published the group before
  with another rank or world (a lease then believed as if it held it now). Raise the member
  count (at most 65,536: that many reads at a publisher's next full read of the group), bump
  the epoch (a re-read), hide or show names in the index (only signed entries count).
* without a secret it is trusted like any peer: it can write any entry, layout, lease or rank
  count as its subject's own (a sharded publisher then writes ``q`` from ``o``, or a version
  completes with one rank's parts), except that an entry's slots must still match what the
  subscriber's record exposes, so a staging subscriber is never written in place. Garbage still
  stops nobody: it is skipped with a warning and its owner writes its value back.

Control messages travel as notifications on channel ``ws/<group>``: msgpack maps on the wire, the
typed values of ``_messages`` (named here in brackets) in the code.

* publisher -> subscriber ``{"k": "hello"}`` (Hello): tell me which slots I may write
* publisher -> subscriber ``{"k": "begin", "v": N, "s": slot}`` (Begin): version N is being
  written
* publisher -> subscriber ``{"k": "ver", "v": N, "s": slot}`` (Ver): the notification of the data
  put: every tensor of version N has landed in ``slot``
* subscriber -> publisher ``{"k": "credit", "s": [slots], "v": newest}`` (Credit): the slots it
  may write now
* publisher -> subscriber ``{"k": "abort", "v": N, "s": slot}`` (Abort): the write of version N
  into ``slot`` was given up (its deadline passed, or its relay failed): a ``ver`` of it that
  still comes is ignored, so a slot the subscriber credits next is never also a version it
  completes; answered like ``hello``
* publisher -> subscriber ``{"k": "lend", "v": N}`` (Lend): the slot version N was to land in is
  cut off (its relay became suspect on the way and owns it until it reports or is gone): hand
  back the slot of your newest version if you applied it (no longer readable from staging, as
  with one slot) and credit again; the publisher writes N there itself, so a chain closes over a
  lost relay within the publish. Answered with a credit, lent or not.

Relayed fan-out (the publisher's ``fanout`` is ``chain`` or ``tree``):

* publisher -> relay ``{"k": "fwd", "v": N, "t": ms, "to": [[child, slot, relays], ...]}``
  (Forward): write version N into each child's slot (within ``t`` milliseconds) as it lands here;
  ``relays`` (0/1): the child forwards it in turn, so announce each segment to it
* writer -> relay ``{"k": "seg", "v": N, "s": slot, "a": i, "b": j}`` (Segment): the notification
  of one segment of version N: the tensors ``i`` to ``j - 1`` of the relay's names in sorted order
  have landed in ``slot``; the relay forwards them at once (a pipeline: every hop copies while the
  one before it still writes). The writer's last segment carries ``ver`` and is posted only after
  the others have landed, so ``ver`` still means "all of it".
* writer -> relay ``{"k": "part", "v": N, "s": slot, "a": i, "o": offset, "n": bytes}`` (Piece):
  the notification of one piece of a tensor larger than a segment: bytes ``offset`` to
  ``offset + bytes - 1`` of tensor ``i`` have landed; the relay forwards them at once, so one huge
  tensor (an embedding) is pipelined too.
* relay -> publisher ``{"k": "fwdr", "v": N, "c": child, "x": outcome, "e": why}`` (Report): what
  became of one forward: outcome ``""`` (landed), ``"lost"`` (the child went away: the publisher
  drops it until it joins again) or ``"fail"`` (anything else, a child whose record the store
  lacks for the moment included: it misses that version and is tried again at the next)

A staging subscriber has two slots. It never credits the slot that holds its newest complete
version, nor the slot an ``apply()`` is copying from, nor a slot it is forwarding from, so nobody
writes what is read. The publisher alone hands out the slots of every subscriber (children credit
the publisher, whoever writes them), and it gives a slot written by a relay back only when that
relay has reported on it (on that version or a later one: its writes to that child have drained)
or is gone, so two writers never share a slot. Meanwhile the slot is fenced: the subscriber has
one slot left, and every version it takes goes into its newest version's slot once applied
(``lend``), as for a one-slot subscriber.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgpack
import torch

from transport.errors import TransferTimeout, WireFormatError
from transport.memory import check_tensor, dtype_name
from transport.signed import Inspector, SignedStore
from transport.store.base import Store
from transport.store.counters import Counter, clock_floor, index_counter
from transport.weights._messages import Begin, Piece, Segment, Ver, encode
from transport.wire import NAME_RE, unpack

log = logging.getLogger("transport.weights")

MODES = ("staging", "inplace")

#: seconds after which a subscriber that has not answered a publisher's hello is asked again
HELLO_AGAIN = 0.5

#: the publisher's own regions (read-only, for late joiners): "<group>@pub/<name>" and the
#: sequence word "<group>@pub/__seq" = [seq (odd while the trainer changes the tensors), version]
PUB_SLOT = "pub"
SEQ_NAME = "__seq"


def check_named_tensors(named: Mapping[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """The tensors of a publisher or subscriber, checked before anything is registered (a
    subscriber's may be meta tensors: shapes and dtypes, whose staging lives elsewhere)."""
    if not named:
        raise ValueError(f"a {role} needs at least one tensor")
    for name, t in named.items():
        if role == "subscriber" and isinstance(t, torch.Tensor) and t.is_meta:
            check_tensor(torch.empty(0, dtype=t.dtype), f"tensor {name!r}")
            continue
        check_tensor(t, f"tensor {name!r}")
    return dict(named)


def match_regions(
    regions: Mapping[str, Any], group: str, tensors: Mapping[str, torch.Tensor], role: str
) -> tuple[list[str], list[str]]:
    """The names of a subscriber's slot-0 regions of ``group`` that ``tensors`` can fill, and
    one problem per region they cannot (missing, or another shape or dtype); ``role`` names the
    side that holds ``tensors`` in the messages."""
    prefix, names, problems = region(group, 0, ""), [], []
    for rname, info in regions.items():
        if not rname.startswith(prefix):
            continue
        n = rname[len(prefix) :]
        t = tensors.get(n)
        if t is None:
            problems.append(f"{n!r}: the {role} has no tensor of that name")
        elif tuple(t.shape) != info.shape or dtype_name(t.dtype) != info.dtype:
            problems.append(
                f"{n!r}: {role} {tuple(t.shape)} {dtype_name(t.dtype)}, subscriber {info.shape} {info.dtype}"
            )
        else:
            names.append(n)
    return names, problems


def exposed_slots(regions: Mapping[str, Any], group: str) -> int:
    """How many slots of ``group`` a subscriber's regions hold (slot 0, then 0 and 1, ...)."""
    head, seen = region(group, "", "")[:-1], set()  # "<group>@", then the slot, then "/"
    for r in regions:
        if r.startswith(head):
            seen.add(r[len(head) :].partition("/")[0])
    slots = 0
    while str(slots) in seen:
        slots += 1
    return slots


def inplace_mark(group: str) -> str:
    """The region an in-place subscriber of ``group`` exposes (one byte nobody reads) to say so
    in its own record: a publisher writes a member in place only when its record has it, so a
    store writer cannot have a staging subscriber's slot written in place by rewriting its
    group entry (it would have to take over the subscriber's record too)."""
    return region(group, "mode", "inplace")


def slot_regions(
    group: str, slots: list[dict[str, torch.Tensor]], mode: str
) -> dict[str, torch.Tensor]:
    """The regions a subscriber of ``group`` exposes: each tensor of each slot, and, when its
    entry says ``mode`` "inplace", the mark that its own record says so too."""
    out = {region(group, k, n): t for k, slot in enumerate(slots) for n, t in slot.items()}
    if mode == "inplace":
        out[inplace_mark(group)] = torch.zeros(1, dtype=torch.uint8)
    return out


def rank_mark(group: str, rank: int, world: int) -> str:
    """The region a sharded trainer's rank exposes (one byte nobody reads) to say in its own
    record which rank of how many it publishes: a subscriber takes the number of ranks whose
    parts make a version from the records of the ranks it hears, so a store writer cannot make
    it complete a version with fewer ranks' parts by rewriting leases (it would have to take
    over the ranks' records too)."""
    return region(group, "rank", f"{rank}-of-{world}")


def marked_rank(regions: Mapping[str, Any], group: str) -> tuple[int, int] | None:
    """(rank, world) as a record's :func:`rank_mark` says (the largest world if it lists
    several: a leftover of an earlier rank of this Transport); None if it has none."""
    prefix, found = region(group, "rank", ""), None
    for name in regions:
        if not name.startswith(prefix):
            continue
        rank, sep, world = name[len(prefix) :].partition("-of-")
        if not (sep and rank.isascii() and rank.isdigit() and world.isascii() and world.isdigit()):
            continue
        mark = (int(rank), int(world))
        if found is None or mark[1] > found[1]:
            found = mark
    return found


def channel(group: str) -> str:
    return f"ws/{group}"


def region(group: str, slot: int | str, name: str) -> str:
    return f"{group}@{slot}/{name}"


class GroupDirectory:
    """The store side of a group: the subscribers' entries and declared layouts, the membership
    index and the epoch, under ``transport/<namespace>/groups/<group>/``.

    It keeps the key prefix, the group's two counters and ``signed``, the Transport's signed
    store values (``transport.core.signed``): ``join``, ``declare_layout`` and ``leave`` write
    and remove that Transport's own entry and layout, of subscriber ``instance`` (a number no
    other subscriber of that Transport incarnation has: a publisher plans a subscriber that
    closed and one made after it on the same Transport apart). Every call is one or more store round
    trips, as thread-safe as the store, and never made on the engine thread.

    Trust (DESIGN.md): an entry (generation, instance, mode, slots, relay) and a layout decide where bytes
    land, so both are signed values that only the subscriber itself writes: a value that is
    malformed, unsigned in a namespace with a secret, not signed by the peer it is the entry of,
    or whose body names another generation than its signature is ignored (logged), as if it
    were missing. A store writer without the secret can still delete a value or put back an
    older one of the same key (a replay): a replayed entry or layout of an older incarnation is
    refused by its readers, who compare its generation with the subscriber's live record
    (``Roster.plan``) or with the member's (``layout``); the subscriber puts back whatever of its
    own is missing or not its own (``check_in``). The epoch and the membership index are plain
    counters and names (garbage in them is repaired by whoever meets it, reader or writer: the
    epoch to the clock in milliseconds, the member count as ``index_counter`` says): forging
    them only makes readers read again, or skip a name, since every entry they lead to is
    signed. The membership index only grows (``names`` drops duplicates); ``leave`` deletes the
    entry only while it is still this subscriber's (incarnation and instance).

    Made from a bare :class:`Store` instead (tools and tests that inspect a group without a
    Transport), it reads values without checking their MACs and refuses to write.
    """

    def __init__(
        self, signed: SignedStore | Store, namespace: str, group: str, instance: int = 0
    ) -> None:
        self.signed = reader(signed)
        self.instance = instance
        store = self.store = self.signed.store
        self.group = group
        self.prefix = f"transport/{namespace}/groups/{group}/"
        # The epoch only has to differ from every value a publisher saw before a change: the
        # clock in milliseconds does, since join and leave count it up by one from 0
        # (clock_floor), and the publisher that repairs it reads the entries after the repair.
        what = f"the changes of group {group!r}"
        self._epoch = Counter(store, self.prefix + "epoch", what, clock_floor)
        self._members = index_counter(
            store, self.prefix + "members/", f"the members of group {group!r}"
        )

    def epoch(self) -> int:
        return self._epoch.value()

    # -- this Transport's own entry and layout ---------------------------------------------------

    def _entry_body(self, mode: str, slots: int, relay: bool) -> bytes:
        body: bytes = msgpack.packb(
            {
                "v": 2,
                "gen": self.signed.generation,
                "inst": self.instance,
                "mode": mode,
                "slots": slots,
                "relay": relay,
            }
        )
        return body

    def join(self, mode: str, slots: int, relay: bool) -> None:
        """Write this Transport's entry (signed), add it to the membership index, bump the
        epoch."""
        self.signed.set(
            self.prefix + f"sub/{self.signed.writer}", self._entry_body(mode, slots, relay)
        )
        self._index(self.signed.writer)
        self._epoch.add(1)

    def declare_layout(self, layout: bytes | None) -> None:
        """The destination layout this Transport's subscriber declares before it joins (None:
        whole tensors by name, declared as :data:`WHOLE`: a missing declaration is not one)."""
        self.signed.set(
            self.prefix + f"layout/{self.signed.writer}", WHOLE if layout is None else layout
        )

    def leave(self) -> None:
        """Remove this Transport's entry and layout, if the entry is still this subscriber's
        (this incarnation's, this instance's)."""
        name = self.signed.writer
        entry = self.entry(name)
        if entry is not None and (entry["gen"], entry["inst"]) == (
            self.signed.generation,
            self.instance,
        ):
            self.store.delete(self.prefix + f"sub/{name}")
            self.store.delete(self.prefix + f"layout/{name}")
            self._epoch.add(1)

    def check_in(self, mode: str, slots: int, relay: bool, layout: bytes | None, full: bool) -> str:
        """The subscriber's periodic check that the store still holds its entry, its place in
        the membership index and its layout as it wrote them (a store that restarted empty, a
        deletion, garbage, a replay of an older incarnation's values): what was wrong, after
        writing it all again (join), or "". ``full`` reads the layout back whole (it may be
        large); otherwise only its presence is checked."""
        name = self.signed.writer
        key = self.prefix + f"sub/{name}"
        why = ""
        if self.store.try_get(key) != self.signed.encode(key, self._entry_body(mode, slots, relay)):
            why = f"our entry {key} is missing or not the one we wrote"
        elif not self._indexed(name):
            why = f"our name is missing from the membership index {self.prefix}members/"
        else:
            lkey = self.prefix + f"layout/{name}"
            body = WHOLE if layout is None else layout
            if (full and self.store.try_get(lkey) != self.signed.encode(lkey, body)) or (
                not full and not self.store.exists(lkey)
            ):
                why = f"our declared layout {lkey} is missing or not the one we wrote"
        if why:
            self.declare_layout(layout)
            self.join(mode, slots, relay)
        return why

    def _index(self, name: str) -> None:
        if not self._indexed(name):
            idx = self._members.add(1)
            self.store.set(self.prefix + f"members/{idx}", name.encode())
            self.store.set(self.prefix + f"members/by-name/{name}", str(idx).encode())

    def _indexed(self, name: str) -> bool:
        """Whether the index holds ``name`` where its by-name key says (two plain keys that any
        store writer may change: a forged one only hides or shows a name, never an entry)."""
        raw = self.store.try_get(self.prefix + f"members/by-name/{name}")
        if raw is None or not _INDEX.fullmatch(raw):
            return False
        return self.store.try_get(self.prefix + f"members/{int(raw)}") == name.encode()

    # -- what readers see -------------------------------------------------------------------------

    def layout(self, name: str, generation: int) -> bytes | None:
        """The destination layout that incarnation ``generation`` of subscriber ``name``
        declared (:data:`WHOLE`: whole tensors by name); None when there is none it signed
        (missing, or not valid: logged)."""
        key = self.prefix + f"layout/{name}"
        value = self.signed.read(key, f"the declared layout {key}", writer=name)
        if value is None:
            return None
        if value.generation != generation:
            log.warning(
                "ignoring the declared layout %s: it is of generation %d, the subscriber's is %d "
                "(an older incarnation's value, put back?)",
                key,
                value.generation,
                generation,
            )
            return None
        return value.body

    def entry(self, name: str) -> dict[str, Any] | None:
        """Subscriber ``name``'s entry: a map of ``gen``, ``inst``, ``mode``, ``slots`` and
        ``relay``; None when there is none it signed (missing, or not valid: logged)."""
        key = self.prefix + f"sub/{name}"
        value = self.signed.read(key, f"the group entry {key}", writer=name)
        if value is None:
            return None
        try:
            m = unpack(value.body, f"the group entry {key}", 4096, max_str=64, max_map=8)
        except WireFormatError as e:
            log.warning("ignoring %s", e)
            return None
        if (
            not isinstance(m, dict)
            or set(m) != {"v", "gen", "inst", "mode", "slots", "relay"}
            or m["v"] != 2
            or not isinstance(m["relay"], bool)
            or m["mode"] not in MODES
            or m["slots"] not in (1, 2)
            or type(m["gen"]) is not int
            or type(m["inst"]) is not int
        ):
            log.warning("ignoring the malformed group entry %s: %s", key, str(m)[:80])
            return None
        if m["gen"] != value.generation:
            log.warning(
                "ignoring the group entry %s: it names generation %d, but generation %d signed it",
                key,
                m["gen"],
                value.generation,
            )
            return None
        return m

    def names(self) -> list[str]:
        """The members that ever joined, in joining order; a name that is not a peer name (the
        store's garbage) is skipped with a warning naming its key."""
        count = self._members.value()
        out = []
        for i in range(1, count + 1):
            key = self.prefix + f"members/{i}"
            raw = self.store.try_get(key)
            if raw is None:
                continue
            name = raw.decode(errors="replace")
            if not NAME_RE.match(name):
                log.warning("skipping %s: %r is not a peer name", key, name[:80])
            elif name not in out:
                out.append(name)
        return out

    def entries(self, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """The entry of every member, or of ``names`` (those that left have none); an entry that
        is not valid is skipped with a warning naming its key, so one bad entry never stops the
        group."""
        out = {}
        for name in self.names() if names is None else names:
            entry = self.entry(name)
            if entry is not None:
                out[name] = entry
        return out


#: a declared layout that says "whole tensors by name" (an encoded layout is never empty)
WHOLE = b""

_INDEX = re.compile(rb"[1-9][0-9]{0,15}")


def reader(store: SignedStore | Store) -> SignedStore:
    """``store`` itself, or for a bare :class:`Store` a read-only :class:`Inspector` of its
    signed values (the envelope checked, not its MAC): for tools and tests that look at a group
    without a Transport. Nothing the library decides reads through the latter."""
    return store if isinstance(store, SignedStore) else Inspector(store)


#: the size of the segments a version is cut into on its way to a relay
SEGMENT_BYTES = 32 << 20


def pieces(t: torch.Tensor, seg_bytes: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """(byte offset, bytes) of the pieces a tensor larger than ``seg_bytes`` travels in, each a
    whole number of elements."""
    size = t.element_size()
    step = max(size, seg_bytes - seg_bytes % size)
    return [(o, min(step, t.nbytes - o)) for o in range(0, t.nbytes, step)]


def piece(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The elements of ``t`` (contiguous) at bytes ``offset`` to ``offset + nbytes - 1``."""
    size = t.element_size()
    return t.reshape(-1)[offset // size : (offset + nbytes) // size]


def segments(tensors: Mapping[str, torch.Tensor], seg_bytes: int = SEGMENT_BYTES) -> list[int]:
    """Where the segments of a relay's tensors (its names in sorted order) begin, and the end:
    consecutive tensors of at least ``seg_bytes`` together; a tensor larger than that is a
    segment of its own (it travels in ``pieces``)."""
    names = sorted(tensors)
    bounds, size = [0], 0
    for i, n in enumerate(names):
        nbytes = tensors[n].nbytes
        if nbytes > seg_bytes and size:
            bounds.append(i)
            size = 0
        size += nbytes
        if size >= seg_bytes and i + 1 < len(names):
            bounds.append(i + 1)
            size = 0
    bounds.append(len(names))
    return bounds


class SegmentedWrite:
    """Writes one version into one slot of a peer in segments, as they become ready: each
    segment is posted at once (announced by a ``seg`` message when the peer relays); the last one
    carries ``ver`` and is posted only once every other one has landed. ``done(error or None)``
    is called once, on ``submit``'s thread, when all of it has landed or the first error is known
    and nothing is in flight any more."""

    def __init__(
        self,
        transport: Any,
        peer: str,
        group: str,
        version: int,
        slot: int,
        deadline: float,
        announce: bool,
        submit: Callable[[Callable[[], Any]], None],
        done: Callable[[BaseException | None], Any],
    ) -> None:
        self.t, self.peer, self.chan = transport, peer, channel(group)
        self.version, self.slot, self.deadline, self.announce = version, slot, deadline, announce
        self.submit, self.done = submit, done
        self._lock = threading.Lock()
        self._pending = 0
        self._last: dict[str, torch.Tensor] | None = None
        self._ended = self._finished = False
        self.error: BaseException | None = None

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"the deadline of version {self.version} passed")
        return left

    def begin(self) -> bool:
        try:
            self.t.core.send_control(self.peer, self.chan, encode(Begin(self.version, self.slot)))
        except Exception as e:
            self.fail(e)
            return False
        return True

    def add(self, a: int, b: int, batch: Mapping[str, torch.Tensor]) -> None:
        """Post the tensors ``a`` to ``b - 1`` (in the peer's sorted names) now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            if self.announce:
                msg = encode(Segment(self.version, self.slot, a, b))
                h = self.t.core.put_control(batch, self.peer, self.chan, msg, self._left())
            else:
                h = self.t.put(dict(batch), self.peer, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def add_part(self, a: int, key: str, t: torch.Tensor, offset: int, nbytes: int) -> None:
        """Post bytes ``offset`` to ``offset + nbytes - 1`` of ``t`` (tensor ``a`` in the peer's
        sorted names) into the same bytes of the peer's region ``key`` now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            src, at = piece(t, offset, nbytes), offset // t.element_size()
            if self.announce:
                msg = encode(Piece(self.version, self.slot, a, offset, nbytes))
                h = self.t.core.put_control_at(
                    src, key, at, self.peer, self.chan, msg, self._left()
                )
            else:
                h = self.t.put(src, self.peer, key, offset=at, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def end(self, last: Mapping[str, torch.Tensor]) -> None:
        """The rest (possibly nothing), with ``ver``, once every segment posted so far landed."""
        with self._lock:
            self._ended, self._last = True, dict(last)
        self._landed(None, count=False)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._ended = True
        self._landed(None, count=False)

    def _landed(self, error: BaseException | None, count: bool = True) -> None:
        with self._lock:
            if count:
                self._pending -= 1
            if error is not None and self.error is None:
                self.error = error
            if not self._ended or self._pending or self._finished:
                return
            self._finished = True
            last, err = self._last, self.error
        if err is None:
            try:
                msg = encode(Ver(self.version, self.slot))
                if last:
                    h = self.t.core.put_control(last, self.peer, self.chan, msg, self._left())
                    h.add_done_callback(lambda h: self.submit(lambda: self.done(h.exception(0))))
                    return
                self.t.core.send_control(self.peer, self.chan, msg)
            except Exception as e:
                err = e
        self.done(err)
