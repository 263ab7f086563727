"""Handles: what put() and get() return.

A handle is single-use: it completes once, with success or an error, and
every transfer it stands for has a deadline, so a handle always completes by
then. ``wait(timeout)`` bounds only the wait: when it runs out it raises
:class:`TransferTimeout` but does not cancel the transfer, which goes on until
it lands or its own deadline passes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol

from transport.errors import TransferTimeout, TransportError
from transport.trace import FlightRecorder, handle_ids

_PENDING, _OK, _FAILED = 0, 1, 2


class Polls(Protocol):
    """What drives a handle's transfers from a waiting thread (the engine's ``Poller``): a call
    advances them; ``spin(seconds)`` says the waiter polls them itself now, for at most that long
    (0: it stopped)."""

    def __call__(self) -> None: ...

    def spin(self, seconds: float) -> None: ...


class Handle:
    """The result of a put or get: wait for it, poll it, or await it.

    ``peers`` lists the peers the transfer went to; after completion
    ``errors`` maps each peer whose part failed to its error.

    It owns its completion state: the parts still to come, the error, the waiters' condition and
    the done-callbacks. Rules: it completes once (later part reports are ignored); the error is
    set before the state turns failed, so a waiter that sees it done always reads the error;
    callbacks run once, on the thread that completed it, outside any lock.

    Users call :meth:`done`, :meth:`wait`, :meth:`exception`, :meth:`add_done_callback` or await
    it. The core's side (the engine and the transfer paths; not for users): :meth:`set_parts`,
    :meth:`part_done`, :meth:`resize`, :meth:`complete_now`, ``poller`` (drives the progress of
    a transfer the caller posted, from the waiting thread), ``recorder`` (where its end is
    recorded) and ``canceller`` (what :func:`give_up` calls).
    """

    __slots__ = (
        "_callbacks",
        "_cond",
        "_error",
        "_remaining",
        "_state",
        "canceller",
        "errors",
        "id",
        "nbytes",
        "op",
        "peers",
        "poller",
        "recorder",
    )

    def __init__(self, op: str, peers: tuple[str, ...], nbytes: int, parts: int) -> None:
        self.op = op
        self.peers = peers
        self.nbytes = nbytes
        self.errors: dict[str, BaseException] = {}
        self._remaining = parts
        self._state = _PENDING
        self._error: BaseException | None = None
        self._cond: threading.Condition | None = None
        self._callbacks: list[Callable[[Handle], Any]] | None = None
        # drives progress from the waiting thread for transfers posted by the caller (fast path)
        self.poller: Polls | None = None
        self.id = next(handle_ids)  # names it in the flight recorder
        self.recorder: FlightRecorder | None = None  # where its end is recorded
        # gives up the transfers it stands for (:func:`give_up`), set where they are made
        self.canceller: Callable[[str], None] | None = None

    # -- the core's side: completion (by an engine, the transfer paths, or a waiter polling) --

    def set_parts(self, parts: int) -> None:
        """How many part reports complete it (before it is shared with another thread)."""
        self._remaining = parts

    def part_done(self, peer: str, error: BaseException | None) -> None:
        with _LOCKS[self.id & _STRIPE]:
            if self._state != _PENDING:
                return
            if error is not None and peer not in self.errors:
                self.errors[peer] = error
            self._remaining -= 1
            if self._remaining > 0:
                return
            if self.errors:
                # the error first: a waiter reads _state without the lock, then _error
                self._error = _summarize(self.op, self.errors, len(self.peers))
                self._state = _FAILED
            else:
                self._state = _OK
            cond, callbacks = self._cond, self._callbacks
            self._callbacks = None
        rec = self.recorder
        if rec is not None:
            if self._error is None:
                rec.record("done", self.id, self.op, self.peers, self.nbytes)
            else:
                kind = "timeout" if isinstance(self._error, TransferTimeout) else "error"
                rec.record(
                    kind, self.id, self.op, self.peers, self.nbytes, None, str(self._error)[:300]
                )
                if rec.on_error is not None:
                    rec.on_error(kind)
        if cond is not None:
            with cond:
                cond.notify_all()
        if callbacks:
            for cb in callbacks:
                _run_callback(cb, self)

    def resize(self, delta: int) -> None:
        """Some parts were replaced by a different number of parts (a retry)."""
        with _LOCKS[self.id & _STRIPE]:
            self._remaining += delta

    def complete_now(self) -> None:
        """Success before the handle was shared with any other thread (the fast path)."""
        self._remaining = 0
        self._state = _OK

    @property
    def settled(self) -> bool:
        """Whether it has completed, without polling anything (the core's check)."""
        return self._state != _PENDING

    @property
    def error(self) -> BaseException | None:
        """Its error once it failed (None while pending or after success); never blocks."""
        return self._error

    # -- public ------------------------------------------------------------------------------

    def done(self) -> bool:
        """Whether the transfer has completed (successfully or not). Never blocks."""
        if self._state == _PENDING and self.poller is not None:
            self.poller()
        return self._state != _PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer completes; raise its error if it failed.

        ``timeout`` bounds this wait only (TransferTimeout when it runs out);
        it does not cancel the transfer.
        """
        if self._state == _PENDING:
            self._block(timeout)
        if self._state == _FAILED:
            assert self._error is not None
            raise self._error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like wait() and return the error instead of raising it (None on success)."""
        if self._state == _PENDING:
            self._block(timeout)
        return self._error

    def add_done_callback(self, fn: Callable[[Handle], Any]) -> None:
        """Call ``fn(handle)`` on completion (at once if already complete). Runs on the engine thread:
        keep it short and never wait on a handle inside it."""
        with _LOCKS[self.id & _STRIPE]:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __await__(self) -> Generator[Any, None, None]:
        if self._state == _PENDING:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()

            def _resolve() -> None:
                if not fut.done():
                    fut.set_result(None)

            def _wake(_: Handle) -> None:
                loop.call_soon_threadsafe(_resolve)

            self.add_done_callback(_wake)
            yield from fut.__await__()
        self.wait(0)

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _OK: "done", _FAILED: "failed"}[self._state]
        return f"<Handle {self.op} {self.nbytes} bytes to {list(self.peers)} {state}>"

    # -- internals ---------------------------------------------------------------------------

    def _block(self, timeout: float | None) -> None:
        if threading.current_thread().name.startswith(ENGINE_THREAD_PREFIX):
            raise RuntimeError(
                "waiting on a handle from the engine thread (a done-callback) would deadlock; "
                "use add_done_callback's argument instead"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = self.poller
        if poller is not None:
            # Fast path: the transfer was posted by the caller; poll it here first, and the engine
            # leaves it to us meanwhile (its polls would contend with ours for the interpreter)
            poller.spin(HOLD_S)
            spin_until = time.perf_counter() + SPIN_S
            while self._state == _PENDING:
                poller()
                if time.perf_counter() > spin_until:
                    break
            if self._state != _PENDING:
                return
            poller.spin(0)  # the engine's polls take over while this thread sleeps
        with _LOCKS[self.id & _STRIPE]:
            if self._cond is None:
                self._cond = threading.Condition(threading.Lock())
            cond = self._cond
        with cond:
            while self._state == _PENDING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(
                        f"waited {timeout:.3g} s for a {self.op} of {self.nbytes} bytes to "
                        f"{list(self.peers)}; it is still in progress (the wait does not cancel it)"
                    )
                # short slices: a poller may complete us without notifying
                cond.wait(0.001 if poller is not None else (left if left is not None else 1.0))
                if poller is not None and self._state == _PENDING:
                    cond.release()
                    try:
                        poller()
                    finally:
                        cond.acquire()


ENGINE_THREAD_PREFIX = "transport-engine"
#: how long a waiter polls a transfer its own thread posted before it sleeps between polls
SPIN_S = 200e-6
#: the longest the engine leaves such a transfer to the waiter: a waiter whose transfer completed
#: in its spin usually posts the next one at once, and its next spin takes over the hold
HOLD_S = 1e-3
# Completion state is guarded per handle: by one of these locks, chosen by the handle's id (a lock
# of its own would cost an allocation on every put). Handles that engines or lanes complete at
# the same time almost never share one.
_STRIPE = 63
_LOCKS = tuple(threading.Lock() for _ in range(_STRIPE + 1))


def _summarize(op: str, errors: dict[str, BaseException], npeers: int) -> BaseException:
    if len(errors) == 1 and npeers == 1:
        return next(iter(errors.values()))
    first_peer, first = next(iter(errors.items()))
    names = ", ".join(sorted(errors))
    msg = f"{op} failed for {len(errors)} of {npeers} peers ({names}); first: {first}"
    try:
        err: BaseException = type(first)(msg)
    except Exception:
        err = TransportError(msg)
    err.__cause__ = first
    return err


def _run_callback(fn: Callable[[Handle], Any], h: Handle) -> None:
    try:
        fn(h)
    except Exception:  # a user's callback must not kill the engine
        import logging

        logging.getLogger(__name__).exception("done-callback %r of %r raised", fn, h)


def give_up(handle: Handle, why: str) -> None:
    """Give up the transfers ``handle`` stands for now, as their deadline would (the engine
    withdraws them within one of its ticks): ``handle`` fails with TransferTimeout naming
    ``why``, and no notification of them is sent. What the connection already carries may
    still land. A handle already complete, or whose transfers were made elsewhere, is left as
    it is (it completes by its own deadline)."""
    cancel = handle.canceller
    if cancel is not None and not handle.done():
        cancel(why)


def wait_all(handles: Iterable[Handle], timeout: float | None = None) -> None:
    """Wait for every handle under one deadline; raise the first error (after all have finished
    or the deadline passed)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    handles = list(handles)
    first: BaseException | None = None
    for h in handles:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        err = h.exception(left)
        if err is not None and first is None:
            first = err
    if first is not None:
        raise first
