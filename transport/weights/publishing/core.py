"""What both publishers of a weight group are built on: :class:`PublisherCore`."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import torch

from transport import (
    ClosedError,
    Handle,
    StoreError,
    TransferTimeout,
    Transport,
    TransportError,
)
from transport.weights.delta.policy import DeltaPolicy
from transport.weights.delta.source import check_delta
from transport.weights.group.lease import PublisherLease
from transport.weights.group.messages import (
    HELLO_AGAIN,
    Credit,
    Hello,
    Message,
    Patched,
    decode_from,
    encode,
)
from transport.weights.group.region_names import channel
from transport.weights.group.worker import Worker
from transport.weights.publishing.delivery import (
    EXCLUDED,
    LOST,
    SUSPECT,
    Callbacks,
    Delivery,
    close_all,
)
from transport.weights.publishing.members import Member, RankMember, Retired, Waiting, replaced_why
from transport.weights.publishing.roster import Roster, SuspectWatch
from transport.weights.supersession import Supersession

if TYPE_CHECKING:
    from transport.contract import PeerView

log = logging.getLogger(__name__)

#: how long past a version's deadline the publisher settles whoever it still waits for, when
#: nothing else did (the transfers' own deadlines report first)
SWEEP_AFTER = 1.0

_Core = TypeVar("_Core", bound="PublisherCore")


M = TypeVar("M", bound=Member)


class _DeltaCopies(Protocol):
    """What the shared handlers read of a publisher's delta copies: the auto policy."""

    policy: DeltaPolicy


class PublisherCore(Generic[M]):
    """The scaffolding that :class:`WeightPublisher` and :class:`ShardedPublisher` share: the
    group's lease, the roster of subscribers, the lock over the members' state, the handles of
    the publishes still open, the thread that runs their callbacks, the worker thread that
    answers messages and watches deadlines (its tick: :meth:`_deadlines`, then the suspects'
    watch), the control channel, and closing.

    Rules: a subclass builds its own state first, then calls ``super().__init__``, which
    subscribes to the group's channel and acquires the lease last (a failure there undoes what
    this class began, and nothing is left registered). The messages of the group's channel and
    the deadlines are handled here, once for both; what differs is each subclass's: its
    credits (``_on_credit``), its writes (``_start``, ``_finished``, ``_write_whole``), what it
    holds per member (``_member_deadlines``, ``_no_start``, ``_awaits_credit``) and the
    messages only it takes (``_on_other``). Every member's state
    is read and changed with ``_lock`` held; the engine thread takes it only without blocking
    (a write that landed settles there when nothing else is to be done, else on the worker). Versions only move forward (:meth:`_next_version`).
    :meth:`close` settles every open handle with ClosedError, stops the threads and gives the
    lease back; a subclass adds its own steps through :meth:`_closing`. ``delta`` is set here
    for both; a subclass makes its copies for a mode in :meth:`_switch_deltas`.
    """

    def __init__(
        self,
        transport: Transport,
        group: str,
        tensors: Mapping[str, torch.Tensor],
        lease: PublisherLease,
        name: str,
        member_type: type[M],
        planner: Callable[[RankMember, PeerView], str] | None = None,
        on_gap: Callable[[M, str], bool] = lambda sub, why: False,
        unpacked: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.transport = transport
        self.group = group
        self.version = -1
        # the newest version a publish began preparing (weights/supersession.py)
        self._preparing: Supersession[int] = Supersession()
        # every version up to this one was published before the tensors last changed
        # (:meth:`_tensors_change`): none of them is written from the tensors any more
        self._changed_after = -1
        self._roster = Roster(transport, group, tensors, member_type, planner, unpacked)
        self._subs = self._roster.members  # name -> Member, the roster's (it adds and drops them)
        self._lock = threading.RLock()
        self._handles: list[Delivery] = []
        self._callbacks = Callbacks(f"{name}-callbacks")
        self._watch = SuspectWatch(
            self._roster, self._lock, lambda: self._handles, transport.heartbeat_interval, on_gap
        )
        self._worker = Worker(name, tick=self._expire, until=lambda: transport.closed)
        self._stop_control: Callable[[], None] = lambda: None
        self._lease = lease
        self._store_down = False  # the last publish could not read the store
        try:
            # the group's channel first: a second publisher or subscriber of the group on this
            # Transport is refused there, and leaves nothing behind
            self._stop_control = transport.core.on_control(channel(group), self._on_message)
            self._lease.acquire()  # one publisher per group (per rank), whichever process
        except BaseException:
            self._undo()
            raise

    def _undo(self) -> None:
        """Undo a construction that failed after this class's part of it began."""
        self._lease.release()
        self._stop_control()
        self._stop_workers()
        self._callbacks.stop()

    def _stop_workers(self) -> None:
        """Stop the threads that change members' state (a subclass with more stops them too)."""
        self._worker.stop()

    # -- membership ------------------------------------------------------------------------------

    def subscribers(self) -> list[str]:
        with self._lock:
            return sorted(self._subs)

    def refresh(self) -> dict[str, str]:
        """Read what changed in the group (weights/publishing/roster.py says what is read when);
        returns the subscribers that cannot be served and why (suspects are judged at each
        publish). A member incarnation that left or was replaced by a newer one is retired
        (:meth:`_retire`): nothing stays held for it."""
        store_lost = self._lease.ensure()
        with self._lock:
            if store_lost:
                self._roster.store_lost = True
            for gone in self._roster.refresh():
                self._retire(gone)
            return {n: s.error for n, s in self._subs.items() if s.error}

    def _reading_ahead(self) -> AbstractContextManager[None]:
        """The store reads of a publish read together, for the block the publish prepares in
        (``Store.reading_ahead``): the lease and ranks (``ensure``), the group's epoch
        (:meth:`refresh`) and the heartbeats of the members (:meth:`_begin`'s suspects) cost one
        round trip on Redis and three on the embedded store, instead of one or two each. (Read
        on a thread of the publisher's while the publish copied the tensors, they saved nothing
        on 2 cores: the threads took turns at the interpreter.) A member planned in between has
        its heartbeat read as before."""
        with self._lock:
            names = list(self._subs)
        core = self.transport.core
        keys = [*self._lease.keys_read(), self._roster.dir.epoch_key]
        hearts = [core.heartbeat_key(n) for n in names]
        return self.transport.store.reading_ahead(keys + hearts)

    def _refresh_for_publish(self, first: Callable[[], None] = lambda: None) -> None:
        """``first()`` (a subclass's own reads of the store at a publish), then :meth:`refresh`:
        a store that cannot be reached stops no publish (the subscribers already known are
        served over their connections, which need no store; a newcomer waits until the store
        answers again), and it is logged once per outage."""
        try:
            first()
            self.refresh()
        except StoreError as e:
            if not self._store_down:
                log.warning(
                    "group %s: cannot read the group from the store (%s); publishing to the %d "
                    "subscribers known, until it answers again",
                    self.group,
                    e,
                    len(self._subs),
                )
            self._store_down = True
        else:
            if self._store_down:
                log.warning("group %s: the store answers again", self.group)
            self._store_down = False

    def _retire(self, gone: Retired) -> None:
        """With the lock held: ``gone.member`` is no longer served (it left, a newer incarnation
        of its name replaced it, or its peer was lost). Every version it still held (waiting for
        a slot, written by a relay, its changes waiting for their answer, waiting to complete)
        gets its outcome now, and the subclass lets go of what it held for it
        (:meth:`_retired`): nothing stays fenced, lent or waited for on its account."""
        sub = gone.member
        sub.retired = True
        self._replaced(cast(M, sub))
        status = LOST if gone.lost else EXCLUDED
        for handle in sub.let_go():
            handle.settle(sub.name, status, gone.why)
        self._retired(gone)

    def _lost(self, sub: M, handle: Delivery, err: BaseException) -> None:
        """With the lock held: a write to ``sub`` met the loss of its peer: ``handle`` says so,
        and the incarnation is retired, dropped until a newer one joins."""
        handle.settle(sub.name, LOST, str(err))
        if self._roster.lose(sub):
            self._retire(Retired(sub, f"it was lost ({err})", lost=True))

    def _unrecorded(self, sub: M, version: int, handle: Delivery, err: BaseException) -> None:
        """With the lock held: a write of ``version`` to ``sub`` found no record of it in the
        store. Not gone: a store that restarted empty lacks it until the peer puts it back
        (within a heartbeat), so it is planned again until the version's deadline
        (:meth:`_replan`), and then written."""
        why = f"it has no record in the store now (tried again until the deadline): {err}"
        if sub.retired:
            handle.settle(sub.name, EXCLUDED, why)
            return
        sub.error, sub.transient = why, True
        if sub.waiting is None:
            sub.waiting = Waiting(version, handle)
        else:  # a newer version waits for it already
            handle.settle(sub.name, EXCLUDED, why)

    def _retired(self, gone: Retired) -> None:
        """With the lock held: the subclass's part of :meth:`_retire` (nothing by default)."""

    def _replaced(self, old: M) -> None:
        """With the lock held: ``old`` is no longer served; if another member of its
        incarnation took its place, the subclass keeps what ``old`` may still be writing from
        that member (nothing by default)."""

    #: the subclass's copies for delta versions, with their ``policy`` (None: delta is off)
    _deltas: _DeltaCopies | None = None

    # -- what a write of a version comes to --------------------------------------------------------

    def _finished(
        self, sub: M, slot: int, version: int, handle: Delivery, err: BaseException | None
    ) -> None:
        """With the lock held: this publisher's write of ``version`` into ``slot`` of ``sub``
        landed (``err`` None) or failed; the subclass defines what follows."""
        raise NotImplementedError

    def _write_whole(self, sub: M, slot: int, version: int, handle: Delivery) -> None:
        """With the lock held: write ``version`` whole into ``slot`` of ``sub``, which refused
        its changes; the subclass defines it."""
        raise NotImplementedError

    def _changes(self, version: int) -> str:
        """What this publisher's changes of ``version`` are called in messages."""
        return f"the changes of version {version}"

    def _on_patch_put(self, sub: M, slot: int | None, version: int, h: Handle) -> None:
        """Worker: the put of the changes of ``version`` (into ``slot``; None: whichever is in
        flight) ended. Landed, the subscriber's ``patched`` tells the rest; failed, the write
        has its outcome now."""
        err = h.exception(0)
        with self._lock:
            p = None if err is None else sub.take_patch(version, slot)
            if p is not None:
                self._finished(sub, p.slot, version, p.handle, err)

    def _on_patched(self, peer: str, m: Patched) -> None:
        """Worker: ``peer`` applied the changes of a version (or refused them: they are written
        whole, unless a newer version is being prepared)."""
        with self._lock:
            sub = self._subs.get(peer)
            p = None if sub is None else sub.take_patch(m.version, m.slot)
            if sub is None or p is None:
                return
            if not m.why:
                p.handle.result.patched[peer] = p.nbytes
                if self._deltas is not None:  # None: delta was turned off since they were sent
                    self._deltas.policy.wrote(True, time.monotonic() - sub.started)
                self._finished(sub, m.slot, m.version, p.handle, None)
                return
            changes = self._changes(m.version)
            if self._superseded(m.version):
                why = f"it refused {changes} ({m.why}), and a newer one is on its way"
                self._finished(sub, m.slot, m.version, p.handle, TransportError(why))
                return
            log.info(
                "group %s: %s refused %s (%s); writing it whole", self.group, peer, changes, m.why
            )
            self._write_whole(sub, m.slot, m.version, p.handle)

    def _patch_deadlines(self, now: float) -> None:
        """With the lock held: changes not applied by their version's deadline fail it."""
        for sub in list(self._subs.values()):
            p = sub.patch
            if p is not None and p.handle.deadline <= now:
                sub.patch = None
                why = f"it did not apply {self._changes(p.version)} within the deadline"
                self._finished(sub, p.slot, p.version, p.handle, TransferTimeout(why))

    # -- delta -----------------------------------------------------------------------------------

    _delta: bool | str = False

    @property
    def delta(self) -> bool | str:
        """``True``, ``False`` or ``"auto"`` (see the class); from the next version on when set
        to another value (turned off, the copies' memory goes; turned on, the next version goes
        whole, and the ones after as changes)."""
        return self._delta

    @delta.setter
    def delta(self, value: bool | str) -> None:
        mode = check_delta(value)
        with self._lock:
            if mode == self._delta:
                return  # the copies and what the policy learned stay
            self._delta = mode
            self._switch_deltas(mode)

    def _switch_deltas(self, mode: bool | str) -> None:
        """With the lock held (or while constructing): the copies and policy for ``mode``, fresh
        (False: none). A subclass that publishes changes defines it."""
        raise NotImplementedError

    # -- publishing ------------------------------------------------------------------------------

    def _next_version(self, version: int | None) -> int:
        """``version``, or the next one, now being prepared: the tensors hold its bytes from
        then on, so it supersedes every older version (weights/supersession.py: one still
        waiting for a slot is never started, and its ``_begin`` gives it up); TypeError or
        ValueError unless it moves forward."""
        if version is None:
            version = self.version + 1 if self.version >= 0 else 1
        elif not isinstance(version, int) or isinstance(version, bool):
            raise TypeError("version must be an int")
        elif version <= self.version:
            raise ValueError(f"versions only move forward: {version} after {self.version}")
        with self._lock:
            live = self._preparing.live
            if live is None or version > live:
                self._preparing.begin(version)
        return version

    def _superseded(self, version: int) -> bool:
        """With the lock held: whether a newer version than ``version`` is being prepared, or
        the tensors changed since it was published (they may hold other bytes already:
        ``version`` is no longer written from them)."""
        return self._preparing.superseded(version) or version <= self._changed_after

    def _tensors_change(self) -> None:
        """The trainer is about to change the tensors (``updating()``): every version published
        so far is superseded. One still waiting for a slot is never started; the next publish
        (or its deadline) gives it up."""
        with self._lock:
            self._changed_after = max(self._changed_after, self.version)

    def _may_start(self, sub: M, version: int, handle: Delivery, via: str | None = None) -> bool:
        """With the lock held: whether :meth:`_start` may write ``version`` to ``sub`` from the
        trainer's tensors now. Not once ``sub`` has its outcome of it (excluded while it
        waited: dropped), nor while a newer version is being prepared (it keeps waiting, and
        the newer one's begin gives it up)."""
        if not handle.waits_for(sub.name):
            return False
        if self._superseded(version):
            sub.waiting = Waiting(version, handle, via)
            return False
        return True

    def _begin(self, version: int, timeout: float, superseded: str) -> tuple[Delivery, list[M]]:
        """With the lock held: the handle of ``version`` (every member pending until
        ``timeout`` seconds from now) and the members to start it at; the others are settled
        now: those that cannot be served, and those whose heartbeat stopped (at once, not at
        the deadline; tried again at the next publish). A version a member still waited for
        is given up (``superseded`` says what it waited for)."""
        subs = list(self._subs.values())
        try:  # their heartbeats
            suspects = self._roster.suspects(s for s in subs if not s.error)
        except StoreError as e:
            # none judged now: the deadline and the watch of the heartbeats settle them
            log.info("group %s: cannot read the subscribers' heartbeats: %s", self.group, e)
            suspects = {}
        self.version = version
        handle = Delivery(
            version, [s.name for s in subs], time.monotonic() + timeout, self._callbacks.submit
        )
        self._handles.append(handle)
        start = []
        for sub in subs:
            if sub.waiting is not None:  # a newer version supersedes the one that waited
                why = sub.error or f"{superseded} before version {version} replaced it"
                sub.waiting.handle.settle(sub.name, EXCLUDED, why)
                sub.waiting = None
            if sub.error and not sub.transient:
                handle.settle(sub.name, EXCLUDED, sub.error)
                continue
            if sub.name in suspects:
                why = f"{SUSPECT}{suspects[sub.name]} (tried again at the next publish)"
                handle.settle(sub.name, EXCLUDED, why)
                continue
            if sub.error:  # planned again until the deadline (:meth:`_replan`)
                sub.waiting = Waiting(version, handle)
                continue
            start.append(sub)
        return handle, start

    # -- messages and deadlines ------------------------------------------------------------------

    def _on_message(self, peer: str, payload: bytes) -> None:
        """Engine thread: decode a message of the group's channel and hand it to the worker. A
        credit says a subscriber's whole state, so only the newest counts, and a flood of them
        (from anyone) queues one piece of work per sender."""
        if (m := decode_from(peer, payload)) is None:
            return
        if isinstance(m, Credit):
            self._worker.latest(("credit", peer), m, functools.partial(self._on_credit, peer))
        elif isinstance(m, Patched):
            self._worker.offer(functools.partial(self._on_patched, peer, m))
        else:
            self._on_other(peer, m)

    def _on_credit(self, peer: str, credit: Credit) -> None:
        """Worker: ``peer`` said which of its slots are free and what they hold; the subclass
        defines what follows."""
        raise NotImplementedError

    def _on_other(self, peer: str, m: Message) -> None:
        """Engine thread: a message other than a credit or a patched (nothing by default)."""

    def _send(self, peer: str, msg: Message) -> None:
        """Send ``msg`` to ``peer`` on the group's channel; a failure is logged (the deadline
        settles what it leaves undone)."""
        try:
            self.transport.core.send_control(peer, channel(self.group), encode(msg))
        except TransportError as e:
            what = type(msg).__name__.lower()
            log.info("group %s: cannot send a %s message to %s: %s", self.group, what, peer, e)

    def _replan(self) -> None:
        """Worker tick: a member whose error may pass by itself (no record yet: a store that
        restarted empty and is being filled again) and that a version waits for is planned
        again every ``HELLO_AGAIN`` seconds, so that it takes that version within its deadline
        instead of only the next one."""
        now = time.monotonic()
        with self._lock:
            for sub in list(self._subs.values()):
                if not (sub.error and sub.transient and sub.waiting is not None):
                    continue
                if now - sub.asked < HELLO_AGAIN:
                    continue
                sub.asked = now
                try:
                    new = self._roster.replan(sub)
                except TransportError as e:  # the store: tried again at the next tick
                    log.info("group %s: cannot plan %s again: %s", self.group, sub.name, e)
                    continue
                if new is None:
                    continue
                new.waiting, sub.waiting = sub.waiting, None
                if new.generation != sub.generation:  # a newer incarnation took its place
                    self._retire(Retired(sub, replaced_why(sub, new.generation), lost=False))
                else:  # the same incarnation: what it relays goes on under its name
                    sub.retired = True
                    self._replaced(sub)
                log.info("group %s: %s planned again; serving it", self.group, new.name)
                self._resume(new)

    def _resume(self, sub: M) -> None:
        """With the lock held: start the version ``sub`` waits for (:meth:`_start`), if it is
        still a member and can be served."""
        waiting = sub.waiting
        if waiting is not None and self._subs.get(sub.name) is sub and not sub.error:
            sub.waiting = None
            self._start(sub, waiting.version, waiting.handle, waiting.via)

    def _start(self, sub: M, version: int, handle: Delivery, via: str | None = None) -> None:
        """With the lock held: write ``version`` to ``sub`` now (or have relay ``via`` write
        it), or wait until it can be (``sub.waiting``); the subclass defines it."""
        raise NotImplementedError

    def _expire(self) -> float:
        """Worker tick: members planned again (:meth:`_replan`), what ran out is settled
        (:meth:`_deadlines`), and those that became suspect while a publish waits for them at
        once (SuspectWatch); returns the seconds to the next tick."""
        self._replan()
        wait = self._deadlines()
        check = self._watch.tick()
        return wait if check is None else max(0.01, min(wait, check))

    def _deadlines(self) -> float:
        """Worker tick: changes not applied in time fail their version; then each member's own
        deadlines (:meth:`_member_deadlines`); a version still waiting for a member at its
        deadline is excluded there (:meth:`_no_start` says why), and a member a version waits
        for that never answered our hello is asked again every ``HELLO_AGAIN`` seconds (the
        answer may have come when it could not reach us: a store that lost our record, say)."""
        now = time.monotonic()
        with self._lock:
            self._patch_deadlines(now)
            for sub in list(self._subs.values()):
                self._member_deadlines(sub, now)
                waiting = sub.waiting
                if waiting is None:
                    continue
                if waiting.handle.deadline <= now:
                    sub.waiting = None
                    waiting.handle.settle(sub.name, EXCLUDED, self._no_start(sub, waiting.version))
                elif self._awaits_credit(sub) and not sub.error and now - sub.asked > HELLO_AGAIN:
                    sub.asked = now
                    self._worker.submit(functools.partial(self._send, sub.name, Hello()))
            return self._next_tick(now)

    def _member_deadlines(self, sub: M, now: float) -> None:
        """With the lock held: what the subclass holds for ``sub`` that ran out (nothing by
        default)."""

    def _no_start(self, sub: M, version: int) -> str:
        """Why ``version``, waiting for ``sub``, could not begin there by its deadline."""
        raise NotImplementedError

    def _awaits_credit(self, sub: M) -> bool:
        """Whether the version waiting for ``sub`` waits for a credit it has not sent."""
        raise NotImplementedError

    def _next_tick(self, now: float) -> float:
        """With the lock held: settle whoever a handle still waits for ``SWEEP_AFTER`` seconds
        past its deadline (the subclass's :meth:`_deadlines`, and the transfers' own deadlines,
        settled those it holds with their reasons first; this is the net under them), drop
        the settled handles; the seconds to the nearest deadline (or to the next hello, while a
        member waits), 1 with nothing open."""
        for h in self._handles:
            if h.deadline + SWEEP_AFTER <= now:  # nobody was left to settle these
                for name in sorted(h.pending):
                    h.settle(name, EXCLUDED, "no outcome within the deadline")
        self._handles = [h for h in self._handles if not h.done()]
        deadlines = [
            h.deadline if h.deadline > now else h.deadline + SWEEP_AFTER for h in self._handles
        ]
        if any(s.waiting is not None for s in self._subs.values()):
            deadlines.append(now + HELLO_AGAIN)
        return max(0.01, min(deadlines) - now) if deadlines else 1.0

    # -- closing ---------------------------------------------------------------------------------

    def _closing(self) -> None:
        """A subclass's own steps of :meth:`close`, after the handles are settled and before
        the lease is given back (nothing by default)."""

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"the weight publisher of group {self.group!r} was closed")

    def close(self) -> None:
        """Stop publishing: a publish still in flight completes now, its handle failed with
        ClosedError (the versions the subscribers completed stay theirs); then the subclass's
        own steps, and the lease is given back. Idempotent."""
        self._stop_control()
        self._stop_workers()
        with self._lock:
            handles, self._handles = self._handles, []
        close_all(handles, self._closed_error())
        self._callbacks.stop()
        self._closing()
        self._lease.release()

    def __enter__(self: _Core) -> _Core:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
