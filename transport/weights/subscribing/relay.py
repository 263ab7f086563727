"""The forwarding side of a staging WeightSubscriber: relayed fan-out (see ``transport.weights.group``).

The publisher tells a relay (``fwd``) to write version N into a child's slot. The relay forwards
each segment of N as it lands here (``seg``), so every hop of a chain copies while the one before
it still writes, and ends with the rest and ``ver`` once N is complete here. The slot N lands in is
held (never credited) from the first forward until the last one ended, and every forward ends
with a report to the publisher, which alone gives the child's slot to another writer.

A version that came here as its changes (a ``patch`` into our inbox) goes on as the same
changes to each child the publisher says holds their base (the target's ``base``), once it is
complete here: the inbox's bytes into the child's inbox, and the child's ``patched`` ends the
forward; a child that refuses them, or a version that came here whole, is written whole. The
report of a forward that the child applied as changes carries their bytes (those written into
its inbox: the blob as it came here), so that the publisher's result says who took the version
as changes, whoever wrote them; one written whole carries 0. The publisher writes our inbox
again only once every forward reading it has ended.

A forward goes to the child's newest incarnation, the one the publisher planned from its group
entry: a connection found lost at the forward's first message (a child that restarted before
this relay noticed) is looked up afresh and told again, so that the loss of the incarnation
before is never reported as the new one's. A forward of changes waiting for the child's
``patched`` ends at its deadline too, so no slot here stays pinned for a child that is gone.

Engine-thread entry points (``on_*``) only record and hand over to the subscriber's worker thread,
where everything else runs, in order. The relay owns its state; what it needs of its subscriber
comes through a :class:`RelayHost`, a handful of explicit calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transport import PeerLostError, PeerNotFoundError, TransferTimeout, TransportError
from transport.weights.group.messages import (
    Begin,
    Forward,
    PartLanded,
    Patch,
    Patched,
    Report,
    Segment,
    encode,
)
from transport.weights.group.region_names import channel, inbox_region, match_regions, region
from transport.weights.group.segments import SegmentedWrite

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelayHost:
    """What a relay may ask of its subscriber; each call takes the subscriber's lock itself, and
    the relay never makes one while it holds its own lock (the lock order is subscriber, then
    relay).

    * ``submit(fn)``: run ``fn`` on the subscriber's worker thread, after what is queued there
      (this relay's own work: its writes' completions; never dropped).
    * ``offer(fn)``: the same for work a message asks for, dropped when a flood of messages
      fills the worker (weights/group/worker.py): only a forward's segments and pieces are offered;
      one that is dropped is sent with the rest once the version is complete here.
    * ``once(key, fn)``: ``fn`` once soon, unless work of ``key`` is queued already (it reads
      the state when it runs): a version's :meth:`Relay.advance`.
    * ``version()``: the newest complete version.
    * ``pin(version, arriving, count)``: atomically, decide where forwards of ``version`` read
      from and hold that slot ``count`` times (never credited while held): returns
      ``(slot, None)``, or ``(None, why)`` when they cannot start now: ``why`` is ``""`` while
      nothing of the version has arrived (``arriving`` is None and it is not complete), else the
      reason they never will (a newer version is complete, or the subscriber does not relay).
    * ``unpin(slot)``: one forward reading ``slot`` ended.
    * ``changed()``: wake whoever waits on the subscriber (its close waits for the relay).
    * ``credit()``: tell the publishers which slots are free now (unless closed).
    * ``inbox``: the subscriber's delta inbox (None: it has none).
    """

    submit: Callable[[Callable[[], Any]], None]
    offer: Callable[[Callable[[], Any]], object]
    once: Callable[[Hashable, Callable[[], Any]], None]
    version: Callable[[], int]
    pin: Callable[[int, int | None, int], tuple[int | None, str | None]]
    unpin: Callable[[int], None]
    changed: Callable[[], None]
    credit: Callable[[], None]
    inbox: torch.Tensor | None = None


@dataclass(frozen=True)
class _Asked:
    """A forward the publisher asked for and that has not started: to ``child``'s ``slot`` by
    ``deadline`` (monotonic); ``relays``: the child forwards in turn; ``base``: the version the
    child holds, for changes (-1: whole)."""

    deadline: float
    publisher: str
    child: str
    slot: int
    relays: bool
    base: int


@dataclass(frozen=True)
class _Changes:
    """A version that came here as its changes: against ``base``, ``nbytes`` of our inbox."""

    base: int
    at: int
    nbytes: int


class _Job:
    """One child's forward of one version."""

    def __init__(
        self, publisher: str, version: int, src: int, child: str, dst: int, base: int = -1
    ) -> None:
        self.publisher, self.version, self.child = publisher, version, child
        self.src, self.dst = src, dst  # our slot, the child's
        self.base = base  # >= 0: its changes, once complete here, if they came as such
        self.ended = False
        self.names: list[str] = []  # the child's names, sorted
        self.index: dict[str, int] = {}
        self.sent: set[str] = set()
        self.pieces: dict[str, dict[int, int]] = {}  # name -> {offset: bytes} forwarded so far
        self.write: SegmentedWrite | None = None
        self.applying = False  # its changes landed at the child: it waits for its ``patched``
        self.nbytes = 0  # the bytes of changes written into the child's inbox (0: none)


class Relay:
    """The forwarding side of one WeightSubscriber (every subscriber has one; one that does not
    relay reports each forward it is asked for as failed): the forwards the publisher asked for
    (``pending``), what of each version has landed here (``incoming``), the writes under way
    (``jobs``) and the names each child takes (``children``).

    ``pending``, ``incoming`` and ``jobs`` are guarded by the relay's own lock. The ``on_*``
    methods run on the engine thread and only record and hand over; everything else runs on the
    subscriber's worker thread, in order, and only there are ``children`` and a job's fields
    touched. The slot a forward reads is pinned at its subscriber (:class:`RelayHost`) from its
    start until it ends. Every forward, started or not, ends with one report to its publisher;
    :meth:`expire` enforces the deadline the publisher gave it.
    """

    def __init__(
        self,
        transport: Any,
        group: str,
        live: Mapping[str, torch.Tensor],
        staging: Sequence[Mapping[str, torch.Tensor]],
        host: RelayHost,
    ) -> None:
        self.t = transport
        self.group = group
        self.live = live
        self.staging = staging  # the subscriber's slots, by index
        self.host = host
        self._lock = threading.Lock()
        self.names = sorted(live)  # the index space of the segments we receive
        self.pending: dict[int, list[_Asked]] = {}  # version -> forwards not started yet
        # version -> (its slot here, the segments (a, b) and pieces (a, offset, bytes) that landed)
        self.incoming: dict[int, tuple[int, list[tuple[int, ...]]]] = {}
        self.jobs: dict[int, list[_Job]] = {}
        self.deadlines: dict[int, float] = {}
        self.children: dict[str, tuple[int, list[str]]] = {}  # child -> (generation, names)
        self.changes: dict[int, _Changes] = {}  # versions that came as changes (the newest)
        self.patching: dict[str, _Job] = {}  # child -> the forward waiting for its ``patched``

    # -- engine thread ---------------------------------------------------------------------------

    def on_fwd(self, peer: str, m: Forward) -> None:
        version, deadline = m.version, time.monotonic() + m.ms / 1000
        with self._lock:
            self.pending.setdefault(version, []).extend(
                _Asked(deadline, peer, t.child, t.slot, t.relays, t.base) for t in m.targets
            )
        self._advance(version)

    def on_changes(self, version: int, base: int, at: int, nbytes: int) -> None:
        """``version`` was made here from its changes in bytes ``at`` on of our inbox."""
        with self._lock:
            self.changes = {version: _Changes(base, at, nbytes)}

    def on_patched(self, peer: str, m: Patched) -> bool:
        """Engine thread: whether ``m`` answers a forward of changes to ``peer`` (handled)."""
        with self._lock:
            job = self.patching.get(peer)
            if job is None or (job.version, job.dst) != (m.version, m.slot):
                return False
            del self.patching[peer]
        self.host.submit(lambda: self.patched(job, m.why))
        return True

    def on_begin(self, m: Begin) -> None:
        version, slot = m.version, m.slot
        newest = self.host.version()
        with self._lock:
            if version > newest:
                self.incoming[version] = (slot, [])
                for v in [v for v in self.incoming if v < newest]:
                    del self.incoming[v]
        self._advance(version)

    def on_seg(self, m: Segment) -> None:
        version, slot, a, b = m.version, m.slot, m.first, m.end
        with self._lock:
            inc = self.incoming.get(version)
            if inc is None or inc[0] != slot or b > len(self.names):
                return
            inc[1].append((a, b))
        self.host.offer(lambda: self.segment(version, (a, b)))

    def on_part(self, m: PartLanded) -> None:
        version, slot, a, offset, nbytes = m.version, m.slot, m.index, m.offset, m.nbytes
        with self._lock:
            inc = self.incoming.get(version)
            if (
                inc is None
                or inc[0] != slot
                or a >= len(self.names)
                or offset + nbytes > self.live[self.names[a]].nbytes
            ):
                return
            inc[1].append((a, offset, nbytes))
        self.host.offer(lambda: self.segment(version, (a, offset, nbytes)))

    def on_complete(self, version: int) -> None:
        self._advance(version)

    def _advance(self, version: int) -> None:
        """:meth:`advance` soon, once however many messages ask for it meanwhile."""
        self.host.once(("advance", version), lambda: self.advance(version))

    # -- worker thread ---------------------------------------------------------------------------

    def advance(self, version: int) -> None:
        """Start the forwards of ``version`` whose slot is known, end them once it is complete
        here, and fail them if it never will be. Runs on the worker thread only, so two never
        overlap."""
        started: list[tuple[_Job, float, bool]] = []
        with self._lock:
            inc = self.incoming.get(version)
            waiting = self.pending.pop(version, [])
            landed = list(inc[1]) if inc is not None else []
        if waiting:
            src, why = self.host.pin(version, None if inc is None else inc[0], len(waiting))
            if src is not None:
                with self._lock:
                    for a in waiting:
                        job = _Job(a.publisher, version, src, a.child, a.slot, a.base)
                        self.jobs.setdefault(version, []).append(job)
                        started.append((job, a.deadline, a.relays))
            elif not why:  # nothing of it here yet: the forwards wait (first in line still)
                with self._lock:
                    self.pending.setdefault(version, [])[:0] = waiting
            else:
                for a in waiting:
                    self.report(a.publisher, version, a.child, "fail", why)
        for job, deadline, relays in started:
            self.start(job, deadline, relays, landed)
        newest = self.host.version()
        complete, superseded = newest == version, newest > version
        if complete or superseded:
            with self._lock:
                jobs = self.jobs.pop(version, [])
                self.incoming.pop(version, None)
            for job in jobs:
                if job.write is None:
                    continue
                if complete and job.base >= 0:
                    self.send_changes(job)
                elif complete:
                    rest = [n for n in job.names if n not in job.sent]
                    job.write.end(self.batch(job, rest))
                else:
                    job.write.fail(TransportError(f"version {version} never completed here"))

    def start(
        self, job: _Job, deadline: float, relays: bool, landed: list[tuple[int, ...]]
    ) -> None:
        job.write = SegmentedWrite(
            self.t,
            job.child,
            self.group,
            job.version,
            job.dst,
            deadline,
            relays,
            self.host.submit,
            lambda err: self.ended(job, err),
        )
        try:
            job.names = self.child_names(job.child)
            job.index = {n: i for i, n in enumerate(job.names)}
        except Exception as e:
            job.write.fail(e)
            return
        if job.base >= 0:
            return  # its changes go once the version is complete here
        if job.write.begin(reconnect=True):
            for got in landed:
                self.forward(job, got)

    def send_changes(self, job: _Job) -> None:
        """The version is complete here: its changes into the child's inbox if they came here
        against the base the child holds, else the version whole."""
        got = self.changes.get(job.version)
        inbox = self.host.inbox
        assert job.write is not None
        if got is None or got.base != job.base or inbox is None:
            self.whole(job)
            return
        with self._lock:
            # a forward of changes still waiting for this child's answer is another
            # incarnation's (the publisher writes one version at a time into an incarnation)
            stale = self.patching.get(job.child)
            self.patching[job.child] = job
        if stale is not None:
            why = f"version {job.version} is forwarded to {job.child} now (it restarted?)"
            self.end_changes(stale, TransportError(why))
        try:
            if not job.write.begin(reconnect=True):
                return
            job.nbytes = got.nbytes
            h = self.t.core.put_control_at(
                inbox[got.at : got.at + got.nbytes],
                inbox_region(self.group),
                0,
                job.child,
                channel(self.group),
                encode(Patch(job.version, job.dst, got.base, got.nbytes)),
                max(0.001, job.write.deadline - time.monotonic()),
            )
        except Exception as e:
            self.end_changes(job, e)
            return
        h.add_done_callback(
            lambda h: self.host.submit(lambda: self.changes_put(job, h.exception(0)))
        )

    def changes_put(self, job: _Job, err: BaseException | None) -> None:
        """The changes landed at the child (its ``patched`` tells the rest, by the forward's
        deadline: :meth:`expire`), or failed."""
        if err is not None:
            self.end_changes(job, err)
        else:
            job.applying = True

    def end_changes(self, job: _Job, err: BaseException) -> None:
        with self._lock:
            if self.patching.get(job.child) is job:
                del self.patching[job.child]
        assert job.write is not None
        job.write.fail(err)

    def patched(self, job: _Job, why: str) -> None:
        """The child applied the changes (``why`` empty: the report says their bytes), or
        refused them: then whole."""
        if job.ended:
            return
        if not why:
            self.ended(job, None, job.nbytes)
            return
        log.info("%s refused the changes of version %d: %s", job.child, job.version, why)
        self.whole(job)

    def whole(self, job: _Job) -> None:
        job.base, job.nbytes = -1, 0
        assert job.write is not None
        job.write.end(self.batch(job, job.names))

    def segment(self, version: int, got: tuple[int, ...]) -> None:
        """A segment (a, b) or a piece (a, offset, bytes) of ``version`` landed here."""
        with self._lock:
            jobs = list(self.jobs.get(version, []))
        for job in jobs:
            self.forward(job, got)

    def forward(self, job: _Job, got: tuple[int, ...]) -> None:
        if job.base >= 0:
            return  # its changes go once the version is complete here
        if len(got) == 2:
            self.send(job, *got)
        else:
            self.send_part(job, *got)

    def send_part(self, job: _Job, a: int, offset: int, nbytes: int) -> None:
        """Forward bytes ``offset`` to ``offset + nbytes - 1`` of our tensor ``a`` if the child
        takes it. A tensor counts as sent once all its bytes were; one sent only in part when the
        version completes goes whole with the rest."""
        name = self.names[a]
        if job.write is None or name not in job.index or name in job.sent:
            return
        got = job.pieces.setdefault(name, {})
        if offset in got:
            return
        got[offset] = nbytes
        src = self.staging[job.src][name]
        job.write.add_part(job.index[name], region(self.group, job.dst, name), src, offset, nbytes)
        if sum(got.values()) >= src.nbytes:
            job.sent.add(name)

    def send(self, job: _Job, a: int, b: int) -> None:
        """Forward our tensors ``a`` to ``b - 1`` that the child takes and has not got yet."""
        if job.write is None:
            return
        names = [n for n in self.names[a:b] if n in job.index and n not in job.sent]
        if not names:
            return
        job.sent.update(names)
        lo, hi = job.index[names[0]], job.index[names[-1]] + 1
        if hi - lo != len(names):  # cannot happen for a child's subset of our names
            job.write.fail(TransportError(f"segment {a}..{b} is not contiguous at {job.child}"))
            return
        job.write.add(lo, hi, self.batch(job, names))

    def batch(self, job: _Job, names: list[str]) -> dict[str, torch.Tensor]:
        return {region(self.group, job.dst, n): self.staging[job.src][n] for n in names}

    def child_names(self, child: str) -> list[str]:
        """The names ``child`` takes (its record is read afresh once per incarnation, and until
        it shows the child's slots: TransportError while it shows none)."""
        conn = self.t.core.peer(child)
        known = self.children.get(child)
        if known is not None and known[0] == conn.generation:
            return known[1]
        conn = self.t.core.peer(child, refresh=True)
        names, problems = match_regions(conn.regions, self.group, self.live, "relay")
        if problems:  # the publisher places a child only under a relay holding all it takes
            raise TransportError(
                f"child {child!r} does not match this relay: {'; '.join(problems)}"
            )
        if not names:
            # a new incarnation whose record does not show its slots yet: a forward of nothing
            # would still end with ``ver``, and the child would take a version it never got
            # (not kept: its record is read again at the next forward)
            raise TransportError(
                f"child {child!r} (generation {conn.generation}) exposes none of group "
                f"{self.group!r}'s slots yet; it takes the next version"
            )
        names.sort()
        self.children[child] = (conn.generation, names)
        return names

    def ended(self, job: _Job, err: BaseException | None, patched: int = 0) -> None:
        """The forward ended: landed (``err`` None; ``patched``: the bytes of changes the child
        applied, 0: it took the version whole) or failed; the publisher is told either way."""
        if job.ended:
            return
        job.ended = True
        with self._lock:
            jobs = self.jobs.get(job.version)
            if jobs is not None and job in jobs:
                jobs.remove(job)
            if self.patching.get(job.child) is job:
                del self.patching[job.child]
        self.host.unpin(job.src)
        if err is None:
            self.report(job.publisher, job.version, job.child, "", "", patched)
        else:
            self.children.pop(job.child, None)  # its record is read afresh next time
            lost = isinstance(err, PeerLostError)
            why = str(err)
            if isinstance(err, PeerNotFoundError):
                # not gone: its record is missing from the store for now (a store that lost it,
                # before the child's next heartbeat puts it back); as the publisher does with a
                # subscriber it cannot plan, tried again at the next version
                why = f"it has no record in the store now (tried again at the next version): {err}"
            self.report(job.publisher, job.version, job.child, "lost" if lost else "fail", why)
        self.host.credit()  # the slot may be free now

    def report(
        self, publisher: str, version: int, child: str, outcome: str, why: str, patched: int = 0
    ) -> None:
        """Tell ``publisher`` what became of the forward of ``version`` to ``child`` (a
        :class:`Report`; ``patched``: the bytes of changes it applied, for a landed forward)."""
        try:
            self.t.core.send_control(
                publisher,
                channel(self.group),
                encode(Report(version, child, outcome, why[:900], patched)),
            )
        except TransportError as e:
            log.info(
                "could not tell %s what became of version %d at %s: %s",
                publisher,
                version,
                child,
                e,
            )

    def expire(self) -> float:
        """Worker tick: forwards past their deadline end (those not started are reported)."""
        now = time.monotonic()
        late, stalled = [], []
        with self._lock:
            for v in list(self.pending):
                late += [(v, a) for a in self.pending[v] if a.deadline <= now]
                self.pending[v] = [a for a in self.pending[v] if a.deadline > now]
                if not self.pending[v]:
                    del self.pending[v]
            for jobs in self.jobs.values():
                stalled += [j for j in jobs if j.write is not None and j.write.deadline <= now]
            # changes that landed at a child that never answered (it died, froze or restarted):
            # their forward ends at its deadline too, or it would pin its slot here for good
            unanswered = [
                j
                for j in self.patching.values()
                if j.applying and j.write is not None and j.write.deadline <= now
            ]
            deadlines = [a.deadline for asked in self.pending.values() for a in asked] + [
                j.write.deadline
                for j in [*(j for js in self.jobs.values() for j in js), *self.patching.values()]
                if j.write is not None
            ]
        for v, a in late:
            why = f"version {v} did not arrive here in time"
            self.report(a.publisher, v, a.child, "fail", why)
        for job in stalled:
            assert job.write is not None
            job.write.fail(TransferTimeout(f"version {job.version} was not complete here in time"))
        for job in unanswered:
            why = f"{job.child} did not apply the changes of version {job.version} in time"
            self.end_changes(job, TransferTimeout(why))
        nearest = min(deadlines, default=None)
        return 1.0 if nearest is None else max(0.01, nearest - now)

    def drop(self) -> None:
        """Leaving: forwards not started are reported; started ones end (each has a deadline)."""
        with self._lock:
            jobs = [(v, j) for v, js in self.pending.items() for j in js]
            self.pending.clear()
        self.host.changed()
        for v, a in jobs:
            self.report(a.publisher, v, a.child, "fail", "the relay left the group")

    def has_pending(self) -> bool:
        """Forwards asked for and not started yet (those started pin their slot)."""
        with self._lock:
            return bool(self.pending)
