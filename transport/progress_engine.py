"""The progress engine: one thread per Transport.

It posts the transfers handed to it (large ones, in parts), polls every
transfer in flight to completion, enforces deadlines, and reads
notifications, which also makes the progress that incoming transfers need on
the receiving side. Small transfers are posted by the caller's thread and only
*tracked* here, so the fast path has no thread hand-off; whichever thread
polls a transfer first completes it.

Idle, the engine sleeps on its doorbell (transport/doorbell.py) until there is
work: a transfer handed to it, a peer that rings because it writes to us, reads
from us or notifies us, or the deadline of a queued transfer; at the latest after
``idle_interval`` (1 s by default), which only bounds what a lost ring costs.
After any activity (a transfer, a notification or a ring) it polls every 50 us
and backs off over the next ``ACTIVE_S`` before it sleeps again; while a
transfer of ours is in flight it polls every 100 us (while the thread that
posted it polls it itself, at most every 1 ms until that thread stops: see
:class:`Poller`) and rings its peer again every ``RING_EVERY``, so a receiver
that needs to make progress for it stays awake.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from transport.backends.base import DONE, Backend
from transport.doorbell import Doorbell
from transport.errors import ClosedError, PeerLostError, TransferTimeout, TransportError
from transport.handle import ENGINE_THREAD_PREFIX, Handle
from transport.peers.conn import PeerConn
from transport.transfers.plan import Part, Plan

log = logging.getLogger(__name__)

QUEUED, POSTED, OK, FAILED, RETIRED = 0, 1, 2, 3, 4  # RETIRED: replaced by a retry

#: after activity the engine polls, backing off from 50 us, this long before it sleeps deeply
ACTIVE_S = 0.2
#: how often (seconds) an awake engine checks deadlines, reads rings and rings peers again
CHECK_S = 0.005


class Op:
    """One backend transfer: one part of a handle, to one peer.

    States: QUEUED, POSTED, then OK or FAILED, once (RETIRED: replaced by a retry's ops). Once it
    is shared, only the thread holding ``lock`` posts, polls or finishes it; ``error`` is set before
    ``state`` turns FAILED. It is posted only after every op of ``after`` is OK (one failed: it
    fails with the same error). A failed op finishes the rest of its ``group``, each with its own
    ``engine``'s backend (one that another thread holds gets its deadline zeroed instead, and that
    thread withdraws it).
    """

    __slots__ = (
        "after",
        "deadline",
        "engine",
        "error",
        "given_up",
        "group",
        "handle",
        "lock",
        "notif",
        "part",
        "plan",
        "retry",
        "state",
        "timeout",
        "wakes",
        "xfer",
    )

    def __init__(
        self, handle: Handle, plan: Plan, part: Part, notif: bytes, deadline: float, timeout: float
    ) -> None:
        self.handle = handle
        self.plan = plan
        self.part = part
        self.notif = notif
        self.deadline = deadline
        self.timeout = timeout
        self.state = QUEUED
        self.error: BaseException | None = None  # why it failed; set before state turns FAILED
        self.given_up: str | None = None  # why it was given up before its deadline
        self.xfer: Any = None
        self.lock = threading.Lock()
        self.after: list[Op] | None = (
            None  # post only once these are done (the notifying last part)
        )
        self.group: list[Op] | None = None  # all parts of this handle to this peer
        self.retry: Any = None  # what the Transport needs to re-plan for a restarted peer
        self.engine: ProgressEngine | None = None  # the engine that runs it, when it is a lane's
        self.wakes: list[ProgressEngine] | None = (
            None  # other engines holding parts that wait for it
        )


class Poller:
    """What a handle posted by its caller polls while it waits (``Handle.poller``): it advances
    the handle's ops that are still posted. ``spin(seconds)`` says the caller polls them itself
    now: the engine, whose polls would only contend with the caller's for the interpreter lock,
    leaves its in-flight polls for at most ``seconds``, or until ``spin(0)`` says the caller
    stopped (which wakes it); a transfer to post or a stop still wakes it at once. The hold is
    the engine's, not the op's: with several waiters, the first to stop ends it (their polls
    then contend again, nothing waits longer). It owns nothing but its list of ops."""

    __slots__ = ("_engine", "_ops")

    def __init__(self, engine: ProgressEngine, ops: list[Op]) -> None:
        self._engine = engine
        self._ops = ops

    def __call__(self) -> None:
        for op in self._ops:
            if op.state == POSTED:
                self._engine.poll(op)

    def spin(self, seconds: float) -> None:
        """The caller polls these ops itself for at most ``seconds`` (0: it stopped)."""
        self._engine.hold_polls(seconds)


class ProgressEngine:
    """The progress engine of one agent (a Transport's or a lane's): a daemon thread named
    ``transport-engine-<name>``, from :meth:`start` to :meth:`stop`.

    It owns the ops handed to it, to post (:meth:`submit`) or to track (posted by a caller), and
    the list in flight, which only its thread touches until :meth:`stop`. Its methods may be
    called from any thread; whichever thread polls an op first completes it (and runs its handle's
    callbacks). It posts one queued part per loop, to a peer with fewer than ``max_posted_parts`` in
    flight. It fails every op past its deadline with TransferTimeout, withdrawing it if posted (a
    handle's ``wait(timeout)`` cancels nothing). The callbacks it is given must not block; an
    exception from the notification callback drops those frames and is counted in
    ``handler_errors`` (a peer's frames never stop the thread). If its thread dies nevertheless
    (a bug of ours), ``error`` is set and every op fails with ClosedError, as at :meth:`stop`.
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        on_notifications: Callable[[dict[str, list[bytes]]], None],
        on_peer_lost: Callable[[PeerConn, BaseException], None],
        on_retry: Callable[[list[Op], BaseException], None] | None = None,
        idle_interval: float = 1.0,
        max_posted_parts: int = 4,
        doorbell: Doorbell | None = None,
    ) -> None:
        self._backend = backend
        self._on_notifications = on_notifications
        self._on_peer_lost = on_peer_lost
        self._on_retry = on_retry
        self.idle_interval = idle_interval
        self.max_posted_parts = max_posted_parts
        self._queue: deque[Op] = deque()  # to be posted by the engine
        self._new: deque[Op] = deque()  # posted by a caller, to be tracked
        self._inflight: list[Op] = []
        self.doorbell = doorbell if doorbell is not None else Doorbell()  # ours, closed at stop
        self._stop = False
        self._last_activity = time.monotonic()
        self.wakeups = 0  # times the thread came back from a sleep (for the idle tests)
        self._floor: float | None = None
        self._held_until = 0.0  # a caller polls its own transfer until then (hold_polls)
        self.error: BaseException | None = None  # set if the engine thread died
        self.handler_errors = 0  # notifications whose handling raised (dropped, logged)
        # whether frames held earlier wait to be handed to on_notifications (with none new)
        self.pending: Callable[[], bool] | None = None
        self.on_finish: Callable[[], None] | None = None  # a lane wakes the main engine
        self._thread = threading.Thread(
            target=self._run, name=f"{ENGINE_THREAD_PREFIX}-{name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- called from user threads ---------------------------------------------------------------

    def post_now(self, op: Op, lost_raises: bool = False) -> None:
        """Post ``op`` on the calling thread (small transfers); the engine tracks it from then on.
        With ``lost_raises``, a PeerLostError while posting (nothing was sent) is raised to the
        caller and leaves ``op`` unposted, so that the caller can retry a restarted peer."""
        with op.lock:
            self._post(op, lost_raises)
        if op.state == POSTED:
            self._new.append(op)
        self.touch()

    def post_fast(self, handle: Handle, plan: Plan, notif: bytes, timeout: float) -> bool:
        """Post a one-part plan from the caller's thread, completing ``handle`` at once when the
        backend finishes during the post. False when the general path must handle it (errors)."""
        op = self.post_inline(handle, plan, notif, timeout)
        if op is None:
            return False
        if op is True:
            handle.complete_now()
        else:
            ops = [op]  # one list for both: the fast path allocates as little as it can
            handle.poller = self.poller(ops)
            handle.canceller = functools.partial(self.give_up, ops)
        return True

    def post_inline(
        self, handle: Handle, plan: Plan, notif: bytes, timeout: float
    ) -> Op | Literal[True] | None:
        """Post one part of ``handle`` (a one-part plan) from the caller's thread. True: the backend
        finished it during the post (the caller accounts for it); an Op: posted and handed to the
        engine, which completes it; None: nothing was sent, the general path must handle it."""
        conn = plan.conn
        part = plan.parts[0]
        if not notif and plan.direct is not None:
            return True if plan.run_direct() else None  # done inside the call (Backend.direct)
        with conn.lock:
            if not conn.alive or not plan.valid:
                return None
            pool = part.idle[bool(notif)]
            try:
                xfer = pool.pop() if pool else plan.take(self._backend, part, notif)
            except TransportError:
                return None
            try:
                st = self._backend.post(xfer, conn.seal(notif), conn.name)
            except TransportError:
                self._backend.release_xfer(xfer)
                return None
            if st == DONE:
                plan.give_back(self._backend, part, xfer, bool(notif))
                if notif:  # the bytes landed; the receiver has yet to read the notification
                    conn.ring()
                return True
            plan.busy += 1
        now = time.monotonic()
        conn.ring(now, bool(notif))
        op = Op(handle, plan, part, notif, now + timeout, timeout)
        op.xfer = xfer
        op.state = POSTED
        self._new.append(op)
        self.touch(now)
        return op

    def submit(self, ops: list[Op]) -> None:
        """Hand ops to the engine thread for posting (large transfers and dependent parts)."""
        if self._stop:
            raise ClosedError("the Transport is closed; open a new one")
        self._queue.extend(ops)
        self.doorbell.wake()

    def poll(self, op: Op) -> None:
        """Advance ``op`` if no other thread is polling it right now. Never blocks."""
        if op.state != POSTED or not op.lock.acquire(blocking=False):
            return
        try:
            if op.state == POSTED:
                self._poll_locked(op)
        finally:
            op.lock.release()

    def poller(self, ops: list[Op]) -> Poller:
        return Poller(self, ops)

    def hold_polls(self, seconds: float) -> None:
        """A caller polls its own transfer: the engine's in-flight polls wait for at most
        ``seconds`` (see :class:`Poller`); 0 ends the hold and wakes the engine, whose polls take
        over (the caller stopped spinning and sleeps between its own polls)."""
        if seconds <= 0:
            if self._held_until:
                self._held_until = 0.0
                self.doorbell.wake()
            return
        until = time.monotonic() + seconds
        if until > self._held_until:
            self._held_until = until

    def wake(self) -> None:
        self.doorbell.wake()

    def touch(self, now: float | None = None) -> None:
        """Something of ours began that the engine must make progress for (a post, a
        notification sent): it polls from now on as after any activity, woken if it slept
        deeply (from a short sleep it comes back soon enough by itself)."""
        self._last_activity = time.monotonic() if now is None else now
        if self.doorbell.deep:
            self.doorbell.wake()

    def give_up(self, ops: list[Op], why: str) -> None:
        """Withdraw ``ops`` now (those not settled yet), as their deadline would: each engine
        holding one fails it with TransferTimeout naming ``why`` at its next check."""
        for op in list(ops):
            if op.state in (QUEUED, POSTED):
                op.given_up = why
                op.deadline = 0.0
                (op.engine or self).wake()

    def poll_at_least(self, interval: float | None) -> None:
        """Keep the idle polling interval at or below ``interval`` (None: back to ``idle_interval``).
        Nothing of the library needs it (peers ring the engine as they send); a user may bound
        the latency of what a lost ring delays with it, at a known CPU cost."""
        self._floor = interval
        self.doorbell.wake()

    def waiting(self, delta: int) -> None:
        """A thread starts (+1) or stops (-1) waiting for a notification: a wait that begins
        makes the engine look once at once (what it waits for comes with a ring of the peer that
        sends it, so nothing more is needed)."""
        if delta > 0:
            self.doorbell.wake()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self.doorbell.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.doorbell.close()
        err = ClosedError("the Transport was closed before the transfer completed")
        for op in list(self._queue) + list(self._new) + self._inflight:
            self.fail(op, err)
        self._queue.clear()
        self._new.clear()
        self._inflight.clear()

    # -- posting, polling, completing ------------------------------------------------------------

    def _post(self, op: Op, lost_raises: bool = False) -> None:
        """Post ``op``; the caller holds ``op.lock``."""
        plan, conn = op.plan, op.plan.conn
        if time.monotonic() > op.deadline:
            self.finish(op, self._timeout_error(op, posted=False))
            return
        xfer = None
        try:
            with conn.lock:
                if not conn.alive or not plan.valid:
                    raise PeerLostError(
                        f"peer {conn.name!r} (generation {conn.generation}) was lost; "
                        "the next put or get reconnects if it has restarted",
                        conn.name,
                    )
                xfer = plan.take(self._backend, op.part, op.notif)
                op.xfer = xfer
                op.state = POSTED
                plan.busy += 1
                st = self._backend.post(xfer, conn.seal(op.notif), conn.name)
            conn.ring(notify=bool(op.notif))
        except BaseException as e:
            group = op.group or [op]
            retry = (
                op.retry is not None
                and self._on_retry is not None
                and isinstance(e, PeerLostError)
                and all(o.state == QUEUED for o in group if o is not op)
            )
            if (lost_raises or retry) and isinstance(e, PeerLostError):
                if op.xfer is not None:
                    self._backend.release_xfer(op.xfer)
                    op.xfer = None
                    with conn.lock:
                        plan.busy -= 1
                op.state = QUEUED
                if lost_raises:
                    raise
                # nothing of this transfer reached the old incarnation: the Transport re-plans it
                # (if the peer restarted) or fails it
                for o in group:
                    o.state = RETIRED
                assert self._on_retry is not None
                self._on_retry(group, e)
                return
            op.state = POSTED  # so that _finish() releases the transfer
            self.finish(op, e)
            return
        if st == DONE:
            self.finish(op, None)

    def _poll_locked(self, op: Op) -> None:
        try:
            st = self._backend.poll(op.xfer, op.plan.conn.name)
        except TransportError as e:
            self.finish(op, e)
            return
        if st == DONE:
            self.finish(op, None)
        elif time.monotonic() > op.deadline:
            self.finish(op, self._timeout_error(op, posted=True))

    def _timeout_error(self, op: Op, posted: bool) -> TransferTimeout:
        conn = op.plan.conn
        if op.given_up is not None:
            return TransferTimeout(
                f"{op.plan.op} of {op.part.nbytes} bytes to peer {conn.name!r} was given up "
                f"({op.given_up}); no notification of it follows, though bytes already on "
                "their way may still land"
            )
        if posted:
            conn.suspect = True
            log.warning(
                "peer %s did not complete a %s of %d bytes within %.3g s; marked suspect",
                conn.name,
                op.plan.op,
                op.part.nbytes,
                op.timeout,
            )
            what = "did not complete it"
        else:
            what = "could not be reached in time to post it"
        return TransferTimeout(
            f"{op.plan.op} of {op.part.nbytes} bytes to peer {conn.name!r}: its deadline of "
            f"{op.timeout:.3g} s passed and the peer {what}; the transfer was given up, and "
            "no notification of it follows, though bytes already on their way may still land "
            "(a frozen or partitioned peer; pass a longer timeout= if it is just slow)"
        )

    def fail(self, op: Op, error: BaseException) -> None:
        with op.lock:
            self.finish(op, error)

    def finish(self, op: Op, error: BaseException | None) -> None:
        """Settle ``op`` (by the thread holding its lock): OK, or FAILED with ``error`` and every
        other part of its group with it; its handle hears of it. A second call does nothing."""
        if op.state in (OK, FAILED):
            return
        xfer, op.xfer = op.xfer, None
        plan = op.plan
        if error is None:
            op.state = OK
            with plan.conn.lock:
                plan.busy -= 1
                plan.give_back(self._backend, op.part, xfer, bool(op.notif))
        else:
            was_posted = op.state == POSTED and xfer is not None
            op.error = error  # before FAILED: a part waiting on it on another engine fails with it
            op.state = FAILED
            if was_posted:
                with plan.conn.lock:
                    plan.busy -= 1
            if xfer is not None and not self._backend.release_xfer(xfer):
                log.warning(
                    "the backend refused to withdraw a failed transfer to %s", plan.conn.name
                )
        op.handle.part_done(plan.conn.name, error)
        if self.on_finish is not None:
            self.on_finish()
        for engine in op.wakes or ():
            engine.wake()  # a lane idling with parts that wait for this one: without it, it
            # would see them only at its next idle poll, up to idle_interval later
        if error is not None:
            if isinstance(error, PeerLostError):
                self._on_peer_lost(plan.conn, error)
            for sib in op.group or ():
                if sib is not op and sib.state in (QUEUED, POSTED):
                    # no part of a failed transfer stays posted
                    if sib.lock.acquire(blocking=False):
                        try:
                            (sib.engine or self).finish(sib, error)  # a lane's own backend
                        finally:
                            sib.lock.release()
                    else:
                        sib.deadline = 0.0  # the thread holding it notices and withdraws it

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # keep the process alive; every waiter gets the error
            log.exception("the transport engine thread died")
            self.error = e
            err = ClosedError(f"the transport engine thread died: {e!r}")
            err.__cause__ = e
            self._stop = True
            for op in list(self._queue) + list(self._new) + self._inflight:
                self.fail(op, err)

    def _loop(self) -> None:
        backend, doorbell = self._backend, self.doorbell
        next_check = 0.0
        while not self._stop:
            now = time.monotonic()
            while self._new:
                self._inflight.append(self._new.popleft())
            posted_any = self._post_queued() if self._queue else False
            if self._inflight:
                for op in self._inflight:
                    self.poll(op)
                self._inflight = [op for op in self._inflight if op.state == POSTED]
                if self._inflight:
                    self._last_activity = now
            if now >= next_check:
                next_check = now + CHECK_S
                self._expire(now)
                if doorbell.rings_waiting():
                    self._last_activity = now
            notifs = backend.get_notifs()
            if notifs or (self.pending is not None and self.pending()):
                self._last_activity = now
                self._deliver(notifs)
            if posted_any:
                continue
            if doorbell.sleep(self._sleep_for(now)):
                self._last_activity = time.monotonic()
            self.wakeups += 1

    def _sleep_for(self, now: float) -> float:
        """How long the loop may sleep: 100 us with transfers in flight, or until a caller's
        hold on its own transfer ends if that is later (:meth:`hold_polls`); after activity
        from 50 us, backing off, for ``ACTIVE_S``; then until the next deadline of a queued
        transfer, at most ``idle_interval`` (never past a floor that a layer set)."""
        if self._inflight:
            interval = max(100e-6, self._held_until - now)
        else:
            quiet = now - self._last_activity
            if quiet < ACTIVE_S:
                interval = max(50e-6, quiet / 20)
            else:
                interval = self.idle_interval
                for op in self._queue:
                    interval = min(interval, max(0.0, op.deadline - now) + 1e-3)
        if self._floor is not None:
            interval = min(interval, self._floor)
        return interval

    def _deliver(self, notifs: dict[str, list[bytes]]) -> None:
        """Hand what peers sent to the handler; whatever it raises on them is logged and counted
        in ``handler_errors``, and those frames are dropped: nothing a peer sends stops the
        engine."""
        try:
            self._on_notifications(notifs)
        except Exception:
            self.handler_errors += 1
            if self.handler_errors.bit_count() == 1:  # the first, then at every power of two
                log.exception(
                    "dropped %d notifications: handling them failed (%d failures in all)",
                    sum(len(f) for f in notifs.values()),
                    self.handler_errors,
                )

    def _post_queued(self) -> bool:
        # the window is per peer: parts a frozen peer never completes hold back only its own
        posted: dict[int, int] = {}
        for op in self._inflight:
            if op.state == POSTED:
                key = id(op.plan.conn)
                posted[key] = posted.get(key, 0) + 1
        for op in list(self._queue):
            if op.state != QUEUED:
                self._queue.remove(op)
                continue
            if posted.get(id(op.plan.conn), 0) >= self.max_posted_parts:
                continue
            if op.after:
                failed = next((a for a in op.after if a.state == FAILED), None)
                if failed is not None:
                    # the same error as the part it waited on (a timeout stays a timeout and
                    # does not mark a frozen peer lost), whichever engine sees it first
                    self._queue.remove(op)
                    assert failed.error is not None  # set before its state turned FAILED
                    self.fail(op, failed.error)
                    continue
                if any(a.state != OK for a in op.after):
                    continue
            self._queue.remove(op)
            with op.lock:
                if op.state == QUEUED:
                    self._post(op)
            if op.state == POSTED:
                self._inflight.append(op)
            self._last_activity = time.monotonic()
            return True  # one post per loop: polls and notifications run between parts
        return False

    def _expire(self, now: float) -> None:
        for op in list(self._queue):
            if op.state == QUEUED and now > op.deadline:
                self._queue.remove(op)
                self.fail(op, self._timeout_error(op, posted=False))
        for op in self._inflight:
            if op.state == POSTED:
                if now > op.deadline:
                    with op.lock:
                        if op.state == POSTED:
                            self.finish(op, self._timeout_error(op, posted=True))
                else:
                    # the receiver stays awake while it is in flight
                    op.plan.conn.ring(now, bool(op.notif))
