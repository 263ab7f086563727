"""WeightSubscriber: the generator's side of a weight group."""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from transport import ClosedError, TransferTimeout, Transport, TransportError, VersionGoneError
from transport.contract import Closing
from transport.weights.group.group_directory import GroupDirectory
from transport.weights.group.lease import GroupLeases
from transport.weights.group.messages import (
    Abort,
    Begin,
    Credit,
    Forward,
    Hello,
    Lend,
    PartLanded,
    Patch,
    Patched,
    Segment,
    Ver,
    decode_from,
    encode,
)
from transport.weights.group.region_names import (
    channel,
    inbox_region,
    slot_regions,
    tell_newest,
)
from transport.weights.group.seqword import read_stable
from transport.weights.group.withdraw import leftovers, withdraw
from transport.weights.group.worker import Worker
from transport.weights.layouts import DestTensor
from transport.weights.layouts.flat import copy_runs_from, flat_copies
from transport.weights.subscribing.membership import Membership
from transport.weights.subscribing.patches import Patches
from transport.weights.subscribing.rank_parts import RankParts
from transport.weights.subscribing.relay import Relay, RelayHost
from transport.weights.subscribing.slots import Slots
from transport.weights.subscribing.snapshot import Snapshot, check_given
from transport.weights.subscribing.upstream import Upstream

log = logging.getLogger(__name__)

#: tells apart the subscribers one process makes (their group entries say which one they are)
_instances = itertools.count(1)

#: how fast a subscriber reads its declared layout back from the store to check it (bytes/s)
LAYOUT_CHECK_BYTES_PER_S = 64 << 10


class WeightSubscriber(Closing):
    """Receives the versions a WeightPublisher of ``group`` sends into ``named_tensors``.

    ``mode="staging"`` (the default) keeps two staging copies that the publisher writes; a version
    reaches the live tensors only when :meth:`apply` copies it, at a moment the generator chooses,
    so a generation in progress never reads a half-written version. ``mode="inplace"`` exposes the
    live tensors themselves, for engines that pause while weights update. ``slots=1`` keeps one
    staging copy (half the memory): its version is handed back to the publisher only once applied
    (:meth:`apply`, or a :meth:`read` ended), and is no longer readable after; until then the
    next publish waits for it. Such a subscriber does not relay.

    :attr:`version` is the newest *complete* version (every tensor landed; -1 before the first).
    Versions only move forward. ``on_update(version)`` runs on the subscriber's own thread after
    each new complete version. The publisher's writes wake this side's engine (they ring its
    doorbell), so an idle subscriber sleeps; ``poll_interval`` (seconds) makes it poll at least
    that often as well.
    A publish that began but did not complete (the publisher died or missed its deadline) never
    changes :attr:`version`; :attr:`incomplete` names it.

    A staging subscriber with ``relay=True`` (the default) forwards the versions it receives to
    other subscribers when the publisher's fan-out is a chain or a tree; it forwards from the
    staging slot of that version, which it keeps untouched until the forward is done.
    When the relay writing it is cut off, the publisher asks it to lend its newest version's slot:
    once that version is applied and unread, the slot is handed back (as with one slot) and the
    version lands there; until that relay reports or is gone, each version lands that way.

    ``named_tensors`` may be meta tensors (shapes and dtypes only) in staging mode, with
    ``staging_device`` naming where the slots live: such a subscriber has no live tensors, and
    the engine reads each version where it landed with :meth:`read` (an inference engine whose
    own loader takes checkpoint tensors does this). ``staging_device`` otherwise defaults to each
    tensor's own device.

    ``layout`` (destination name -> :class:`~transport.weights.layouts.DestTensor`) declares
    what each of ``named_tensors`` is made of, for a sharded trainer (:class:`ShardedPublisher`):
    its own tensor-parallel shard, fused parameters, renames, another dtype. Without it, each
    tensor is the source tensor of its name, whole. A version of a sharded trainer is complete
    only once every rank's parts of it have landed (one ``ver`` per rank, into the same slot);
    a version that a rank gave up (or that never completed before a newer one began) is never
    presented, and the version before it stays readable. ``source_shapes`` (source name ->
    global shape) goes with the layout: a trainer whose tensors have other shapes (a trainer of
    another model, whose slices would still fit) is refused with the tensors named.

    ``delta=True`` gives the subscriber an inbox for a version's changes (a quarter of its
    bytes; an int: that many bytes), which a publisher with ``delta=`` writes instead of the
    whole version when the slot it writes holds the version the changes apply to: a staging
    subscriber keeps its free slot a copy of its newest version (made when the slot frees),
    one in place applies them to its live tensors (inside the window of a
    :class:`WindowedSubscriber`), bit for bit, before the version is complete; a slot a write
    of another version left torn takes no changes. Every rank of a sharded trainer writes the
    changes of its own parts. Changes made for another version, other tensors, or that break a
    rule of their format are refused (the publisher then writes the version whole).
    """

    #: the mode a subclass shows publishers in its group entry (``staging``: they write only the
    #: slots it credits); None: its own ``mode``
    JOINS_AS: str | None = None

    def __init__(
        self,
        transport: Transport,
        named_tensors: Mapping[str, torch.Tensor],
        group: str = "policy",
        mode: str = "staging",
        on_update: Callable[[int], object] | None = None,
        poll_interval: float | None = None,
        relay: bool = True,
        staging_device: torch.device | str | None = None,
        layout: Mapping[str, DestTensor] | None = None,
        source_shapes: Mapping[str, Sequence[int]] | None = None,
        slots: int = 2,
        delta: bool | int = False,
    ) -> None:
        given = check_given(
            named_tensors, mode, slots, relay, staging_device, layout, source_shapes
        )
        live, self.layout = given.live, given.layout
        #: only shapes and dtypes were given (meta tensors): versions are read with read()
        self.spec_only = given.spec_only
        self.transport = transport
        self.group = group
        self.mode = mode
        self._entry = self.JOINS_AS or mode  # the mode the group entry shows publishers
        self.on_update = on_update
        self.live = live
        self.slots = given.slots
        if mode == "staging":
            # each slot one flat buffer per device (views for the tensors): registered once
            self.staging = flat_copies(self.live, self.slots, staging_device)
            # apply() copies by byte runs: one per buffer when the live tensors are flat too
            self._runs = [] if self.spec_only else copy_runs_from(self.live, self.staging)
        else:
            self.staging = [self.live]
        self._lock = threading.Condition()
        self._slots = Slots(self.slots, self._lock)
        #: delta versions: ``deltas.patched`` came as changes, ``deltas.refused`` were refused
        self.deltas = Patches(
            delta,
            self.staging,
            self._slots,
            mode == "inplace",
            self._submit,
            self._credit_if_open,
        )
        self.version = -1
        self.applied_version = -1
        self.incomplete: int | None = None
        self.begun = -1  # the newest version a publisher began writing here
        self._ranks = RankParts(group, self.slots)  # a sharded trainer's parts in flight
        self._publishers: set[str] = set()
        self._closed = False
        self.relay = relay and mode == "staging" and self.slots == 2
        self._relay = Relay(
            transport,
            group,
            self.live,
            self.staging,
            RelayHost(
                submit=self._submit,
                offer=lambda fn: self._worker.offer(fn),
                once=lambda key, fn: self._worker.latest(key, None, lambda _: fn()),
                version=self._newest_version,
                pin=self._pin,
                unpin=self._unpin,
                changed=self._changed,
                credit=self._credit_if_open,
                inbox=None if self.deltas.inbox is None else self.deltas.inbox.buffer,
            ),
        )
        self._next_entry_check = math.inf  # checked once we joined (below)
        self._dir = GroupDirectory(
            transport.core.signed, transport.namespace, group, next(_instances)
        )
        self._upstream = Upstream(GroupLeases(transport, group), group, self._dir, self._submit)
        self._declared = given.declared
        self._membership = Membership(
            self._dir, self._entry, self.slots, self.relay, self._declared
        )
        self._next_layout_check = math.inf
        ended = lambda: transport.closed  # noqa: E731 - the worker's end condition
        self._worker = Worker(f"transport-ws-sub-{group}", tick=self._tick, until=ended)
        self._stop_control: Callable[[], None] = lambda: None
        self._exposed: list[str] = []
        try:
            self._stop_control = transport.core.on_control(channel(group), self._admit)
            exposed = slot_regions(group, self.staging, self._entry)
            if self.deltas.inbox is not None:
                exposed[inbox_region(group)] = self.deltas.inbox.buffer
            leftovers(transport, group)  # of a closed member of the group, if its close ran out
            transport.expose_all(exposed, access="w")
            self._exposed = list(exposed)
            # the publisher rings our engine as it writes (transport/doorbell.py)
            if poll_interval is not None:
                transport.core.poll_at_least(poll_interval)
            self._dir.declare_layout(self._declared)
            self._dir.join(self._entry, self.slots, self.relay)
            self._next_entry_check = self._next_layout_check = time.monotonic() + 1.0
        except BaseException:
            self._stop_control()
            self._worker.stop()
            self._withdraw()
            raise

    # -- messages from publishers (engine thread: only bookkeeping here) ---------------------------

    def _admit(self, peer: str, payload: bytes) -> None:
        """Only the group's publisher and relays are heard (see ``Upstream``), and the children
        our relay waits on for a ``patched`` (only their messages are decoded here: the rest
        are decoded once, by ``_on_message``)."""
        if (
            peer in self._relay.patching
            and isinstance(m := decode_from(peer, payload), Patched)
            and self._relay.on_patched(peer, m)
        ):
            return
        self._upstream.admit(peer, payload, self._on_message)

    def _on_message(self, peer: str, payload: bytes) -> None:
        m = decode_from(peer, payload)
        if m is None:
            return
        # the flight recorder keeps what each message said (versions, slots): a torn or lost
        # version is read back from the dumps of both ends
        self.transport.recorder.record("ws-in", op=type(m).__name__, peers=peer, info=repr(m)[:200])
        if isinstance(m, Hello):
            with self._lock:
                self._publishers.add(peer)
            self._worker.latest(("hello", peer), None, lambda _: self._send_credit(peer, True))
        elif isinstance(m, Abort):
            with self._lock:
                self._publishers.add(peer)
                if 0 <= m.slot < self.slots and m.version > self.version:
                    self._slots.abort(m.slot, m.version)
                    if self.incomplete == m.version:
                        self.incomplete = None
                    self._ranks.give_up(m.version, f"{peer} gave it up", self._upstream.world)
            self._worker.latest(("credit", None), None, lambda _: self._credit_publishers())
        elif isinstance(m, Lend):
            self._lend(peer, m.version)
        elif isinstance(m, Begin):
            with self._lock:
                if self.mode == "inplace" and self.version < self.begun != m.version:
                    self._slots.dirty = True  # a write of another version began and never ended
                self.begun = max(self.begun, m.version)
                if m.version > self.version:
                    self.incomplete = m.version
                if self._slots.aborted.get(m.slot, m.version) != m.version:
                    del self._slots.aborted[m.slot]  # another version is written there now
                self._slots.begin(m.slot, m.version)
            if self.relay and 0 <= m.slot < self.slots:
                self._relay.on_begin(m)
        elif isinstance(m, Ver):
            self._on_version(peer, m.version, m.slot)
        elif isinstance(m, Patch):
            self._worker.submit(lambda: self._patch(peer, m))
        elif isinstance(m, Segment):
            if self.relay:
                self._relay.on_seg(m)
        elif isinstance(m, PartLanded):
            if self.relay:
                self._relay.on_part(m)
        elif isinstance(m, Forward):
            self._relay.on_fwd(peer, m)

    def _on_version(self, peer: str, version: int, slot: int) -> None:
        if not 0 <= slot < self.slots:
            log.warning(
                "%s announced version %d in slot %d, which does not exist", peer, version, slot
            )
            return
        with self._lock:
            why = self._slots.refuses(slot, version)
            if why:
                log.warning(
                    "group %s: ignoring version %d in slot %d from %s: %s",
                    self.group,
                    version,
                    slot,
                    peer,
                    why,
                )
                return
            rank, world = self._upstream.rank_of(peer), self._upstream.world
            if not self._ranks.landed(peer, rank, world, version, slot):
                return  # another rank's parts are still on their way
            newer = version > self.version
            if newer:
                with self.deltas.freeing():
                    self._slots.landed(slot, version)
                self.version = version
                if self.mode == "inplace":
                    self.applied_version = version
                if self.incomplete is not None and self.incomplete <= version:
                    self.incomplete = None
                self._lock.notify_all()
            self._ranks.settled = max(self._ranks.settled, version)
        if self._entry == "staging":
            # credits go to the publisher, which hands out the slots, even when a relay wrote
            self._worker.latest(("credit", peer), None, lambda _: self._credit_publishers(peer))
        elif self._publishers:  # the ranks of a sharded trainer learn it is complete
            self._worker.latest(("credit", None), None, lambda _: self._credit_publishers())
        if self.relay:
            self._relay.on_complete(version)
        if newer and self.on_update is not None:
            cb = self.on_update
            self._worker.submit(lambda: cb(version))

    def _patch(self, peer: str, m: Patch) -> None:
        """Worker: make slot ``m.slot`` version ``m.version`` by the changes in the inbox; tell
        ``peer`` whether it could."""
        with self._lock:
            if self._slots.aborted.get(m.slot) == m.version:
                return  # given up by its publisher, whose next credit may hand this slot out
            window = self.mode == "staging" or self._entry == "inplace" or self._free_slots()
        why = self.deltas.apply(m, bool(window), self._upstream.world == 1)
        if why:
            log.info("group %s: refusing the changes of version %d: %s", self.group, m.version, why)
        else:
            if self.relay:  # it forwards them as they are
                self._relay.on_changes(m.version, m.base, m.at, m.nbytes)
            self._on_version(peer, m.version, m.slot)
        try:  # to the incarnation that sent them (a relay may have restarted since we last wrote)
            tell_newest(
                self.transport, peer, self.group, encode(Patched(m.version, m.slot, why[:512]))
            )
        except TransportError as e:
            log.info("could not tell %s what became of version %d: %s", peer, m.version, e)

    def _lend(self, peer: str, version: int) -> None:
        """A publisher lost the slot ``version`` was to land in: hand back the newest version's
        slot once applied and unread (no longer readable, as with one slot); credit either way."""
        with self._lock:
            self._publishers.add(peer)
            self._slots.lend_for = max(self._slots.lend_for, version)
            self._slots.hand_back_if_due(self.version, self.applied_version)
        self._worker.latest(("credit", None), None, lambda _: self._credit_publishers())

    def _tick(self) -> float:
        """Worker tick: relay deadlines, and joining the group again if the store lost our entry
        (a Redis restarted without persistence: publishers would drop us on their next read), or
        holds another in its place (garbage, a forgery, an older incarnation's put back), or lost
        our place in the membership index or our declared layout. The layout is read back whole
        at most once a second and once per 64 KiB of it a second (it may be megabytes); between
        those, only its presence is checked."""
        wait = min(self._relay.expire(), self._upstream.refresh())
        now = time.monotonic()
        if now >= self._next_entry_check and not self._closed:
            self._next_entry_check = now + 1.0
            full = now >= self._next_layout_check
            if full:
                size = 0 if self._declared is None else len(self._declared)
                self._next_layout_check = now + max(1.0, size / LAYOUT_CHECK_BYTES_PER_S)
            try:
                why = self._membership.check_in(full)
                if why:
                    log.warning("group %s: %s; joined again", self.group, why)
            except TransportError as e:
                log.info("group %s: cannot check our entry: %s", self.group, e)
        return min(wait, max(0.01, self._next_entry_check - now))

    # -- what the relay asks of us (RelayHost) ---------------------------------------------------

    def _submit(self, fn: Callable[[], object]) -> None:
        self._worker.submit(fn)

    def _newest_version(self) -> int:
        with self._lock:
            return self.version

    def _pin(self, version: int, arriving: int | None, count: int) -> tuple[int | None, str | None]:
        with self._lock:
            if self._closed or not self.relay:
                return None, "this subscriber does not relay (closed, or relay=False)"
            return self._slots.pin_forwards(version, self.version, arriving, count)

    def _unpin(self, slot: int) -> None:
        with self._lock, self.deltas.freeing():
            self._slots.unpin(slot)
            self._lock.notify_all()

    def _changed(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _credit_if_open(self) -> None:
        if not self._closed:
            self._credit_publishers()

    def _free_slots(self) -> list[int]:
        """Under the lock: the slots a publisher may write (a subclass's rule may differ)."""
        return self._slots.free()

    def _credit_publishers(self, sender: str | None = None) -> None:
        """Tell the publishers (those that said hello) which slots are free; a version written by
        a relay is credited to them, not to the relay. Before any hello: the sender."""
        with self._lock:
            targets = list(self._publishers) or ([sender] if sender is not None else [])
        for p in targets:
            self._send_credit(p)

    def _send_credit(self, peer: str, reconnect: bool = False) -> None:
        if self._closed:
            return
        try:
            if reconnect:  # a hello may come from a publisher that restarted under the same name
                self.transport.core.peer(peer, refresh=True)
            with self._lock:
                free, newest, settled = self._free_slots(), self.version, self.settled
                holds = tuple(self._slots.holds(k) for k in free)
            credit = Credit(tuple(free), newest, settled, holds)
            self.transport.core.send_control(peer, channel(self.group), encode(credit))
        except TransportError as e:
            log.info("could not tell %s which slots are free: %s", peer, e)

    # -- the generator's side --------------------------------------------------------------------

    def wait_for_version(self, min_version: int, timeout: float | None = None) -> int:
        """Block until a version >= ``min_version`` is complete; returns it. TransferTimeout at the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.version < min_version:
                self._check_waiting(min_version)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    began = f", version {self.incomplete} began but did not complete" * bool(
                        self.incomplete
                    )
                    raise TransferTimeout(
                        f"version {min_version} of group {self.group!r} did not arrive within "
                        f"{timeout:.3g} s (newest complete: {self.version}{began})"
                    )
                self.transport.core.waiting(+1)
                try:
                    self._lock.wait(1.0 if left is None else min(left, 1.0))  # notified
                finally:
                    self.transport.core.waiting(-1)
            return self.version

    def _check_waiting(self, min_version: int) -> None:
        """Under the lock, in every turn of a wait: raise what ends the wait early."""
        if self._closed:
            raise ClosedError("the subscriber was closed")

    def pull(self, publisher: str, timeout: float | None = None) -> int:
        """Read the publisher's current state straight into the live tensors (one-sided READs; the
        trainer does not pause) and return its version: for a generator that joins mid-run and should
        not wait for the next publish. The publisher must wrap its updates in ``updating()``; a read
        that overlapped an update is retried until ``timeout`` (TransferTimeout then)."""
        if self.spec_only:
            raise ValueError("this subscriber has no live tensors (it was given meta tensors)")
        version = read_stable(
            self.transport, self.group, publisher, self.live, timeout, self._slots.pulling
        )
        with self._lock:
            self.applied_version = max(self.applied_version, version)
            if self.mode == "inplace" and version > self.version:
                self.version = version
                self._lock.notify_all()
        return version

    def apply(self) -> int:
        """Copy the newest complete version into the live tensors (staging mode); returns the version
        the live tensors now hold. In inplace mode there is nothing to copy."""
        if self.mode == "inplace":
            return self.version
        if self.spec_only:
            raise ValueError(
                "this subscriber has no live tensors (it was given meta tensors): read the "
                "versions where they land with read()"
            )
        with self._lock:
            if self._closed:
                raise ClosedError("the subscriber was closed")
            slot = self._slots.newest
            if (
                slot is None
                or self._slots.handed_back
                or self._slots.version[slot] <= self.applied_version
            ):
                return self.applied_version
            self._slots.hold(slot)
            version = self._slots.version[slot]
        try:
            self._runs[slot].run()
        finally:
            self._release(version)
        return version

    @contextmanager
    def read(self, version: int | None = None, timeout: float | None = None) -> Iterator[Snapshot]:
        """Hold a complete version where it landed (staging mode) and yield it as a
        :class:`Snapshot`; no publisher or relay writes that slot until the ``with`` block ends.
        ``version=None`` holds the newest complete version (waiting up to ``timeout`` for a
        first one); a number holds exactly that version, waiting for it up to ``timeout``
        (TransferTimeout, which names the newest complete and any incomplete version), and
        raises VersionGoneError if a newer version already replaced it. For a subscriber without
        live tensors (meta ones), reading a version counts as applying it
        (:attr:`applied_version`). One read or apply at a time."""
        if self.mode != "staging":
            raise ValueError("read() holds a staging slot: this subscriber is in place")
        self.wait_for_version(0 if version is None else version, timeout)
        with self._lock:
            if self._closed:
                raise ClosedError("the subscriber was closed")
            # only the newest version's slot is kept from writers (the others may be written)
            if self._slots.handed_back:
                raise VersionGoneError(f"version {self.version} was applied and its slot reused")
            if version is not None and self.version != version:
                raise VersionGoneError(
                    f"version {version} of group {self.group!r} is no longer held here: "
                    f"version {self.version} replaced it; read version {self.version} "
                    "(or version=None for the newest)"
                )
            slot = self._slots.newest
            assert slot is not None  # a version is complete
            self._slots.hold(slot)
            got = self._slots.version[slot]
        try:
            yield Snapshot(got, self.staging[slot])
        finally:
            self._release(got if self.spec_only else None)

    def _release(self, applied: int | None) -> None:
        with self._lock, self.deltas.freeing():
            self._slots.held = None
            if applied is not None:
                self.applied_version = max(self.applied_version, applied)
            # a lend asked for before this apply
            self._slots.hand_back_if_due(self.version, self.applied_version)
            newest = self._slots.newest
            if self.slots == 1 and newest is not None:  # applied: the publisher may write it
                self._slots.handed_back = self._slots.version[newest] <= self.applied_version
            publishers = list(self._publishers)
        for p in publishers:  # the slot may be free again if a newer version arrived meanwhile
            self._worker.latest(("send", p), p, self._send_credit)

    @property
    def settled(self) -> int:
        """The newest version this side is done with: complete, or given up."""
        return self._ranks.settled

    @property
    def refused_messages(self) -> int:
        """Messages ignored: their sender is neither the group's publisher nor a relay (logged)."""
        return self._upstream.refused

    def close(self) -> None:
        """Leave the group (publishers drop this subscriber on their next publish) and withdraw
        its regions (``Transport.unexpose``, at most ``min(transport.timeout, 10)`` s in all: see
        weights/group/withdraw.py), so that a new member of the group may use this Transport.
        The leave is the last word on our entry: a periodic check of it that began before waits
        to end first (membership.py), and none begins after."""
        if self._closed:
            return
        self._closed = True
        # a relay leaves once its forwards ended (each has a deadline); their slots go back
        self._worker.submit(self._relay.drop)
        with self._lock:
            self._lock.wait_for(
                lambda: not self._slots.forwarding and not self._relay.has_pending(),
                self.transport.timeout,
            )
        self._membership.leave(min(self.transport.timeout, 10.0))
        self._worker.stop()
        self._stop_control()
        self._withdraw()  # while polling fast: the peers' answers come as control messages
        self.transport.core.poll_at_least(None)
        with self._lock:
            if self.mode == "staging":  # the slots' memory goes now (a read keeps its own)
                self.staging[:] = [{} for _ in self.staging]
                self._runs = []
            self._lock.notify_all()

    def _withdraw(self) -> None:
        """Give the regions back (weights/group/withdraw.py) for a new member of the group here."""
        names, self._exposed = self._exposed, []
        withdraw(self.transport, names, f"the subscriber of group {self.group!r}")

    def __repr__(self) -> str:
        return f"<WeightSubscriber {self.group} {self.mode} version={self.version} applied={self.applied_version}>"
