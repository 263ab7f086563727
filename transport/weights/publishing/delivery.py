"""What becomes of one published version: the publisher's record of it (``Delivery``), the
users' view of it (:class:`PublishHandle`), its outcome per subscriber (:class:`PublishResult`)
and the thread its done-callbacks run on (:class:`Callbacks`)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transport import ClosedError, Handle, TransferTimeout
from transport.contract import give_up

log = logging.getLogger(__name__)

DONE, EXCLUDED, LOST = "done", "excluded", "lost"


#: how the reason of a subscriber excluded for being suspect begins
SUSPECT = "suspect: "


@dataclass
class PublishResult:
    """What became of one version at each subscriber: ``done``, ``excluded`` (too slow, or its
    tensors do not match) or ``lost`` (it went away). ``reasons`` explains the last two."""

    version: int
    status: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    #: subscribers a relay was asked to serve -> that relay (the others were written directly)
    via: dict[str, str] = field(default_factory=dict)
    #: subscribers that took the version as its changes (``delta=True``) -> the bytes of
    #: changes written into their inbox and applied there, whoever wrote them: the publisher, or
    #: the relay in ``via`` (which forwards the blob it took, so the same bytes), as its report
    #: says; the others that are done took it whole (one that refused the changes too)
    patched: dict[str, int] = field(default_factory=dict)

    def with_status(self, s: str) -> list[str]:
        return sorted(n for n, v in self.status.items() if v == s)

    @property
    def done(self) -> list[str]:
        return self.with_status(DONE)

    @property
    def excluded(self) -> list[str]:
        return self.with_status(EXCLUDED)

    @property
    def lost(self) -> list[str]:
        return self.with_status(LOST)

    @property
    def suspects(self) -> list[str]:
        """The excluded subscribers that were suspect at the publish (no heartbeat lately: frozen
        or gone; :data:`SUSPECT` starts their reason)."""
        return sorted(n for n in self.excluded if self.reasons.get(n, "").startswith(SUSPECT))


class Callbacks:
    """The thread a publisher's done-callbacks run on: users' code, so never on a thread of ours
    that holds a lock or serves the protocol. A publisher settles its versions under its own
    lock; the callbacks of a version it completes are handed here, and run in completion order,
    each once: one that raises is logged and changes nothing else; one that blocks (waits for
    another version, say) holds only the callbacks behind it; one may call the publisher back
    (publish, read its state). The thread starts with the first callback and ends at
    :meth:`stop`, after the callbacks handed over before it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._stopped:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._q.put(fn)
                return
        fn()  # after stop (a version the closing publisher fails): on the closing thread

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            fn()  # run_callbacks: never raises

    def stop(self, timeout: float = 5.0) -> None:
        """Run the callbacks handed over so far, then end the thread (waits up to ``timeout``
        unless called from a callback)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            if thread is not None:
                self._q.put(None)
        if thread is not None and threading.current_thread() is not thread:
            thread.join(timeout)


def run_callbacks(handle: PublishHandle, fns: list[Callable[[PublishHandle], Any]]) -> None:
    """Call each of ``fns`` with ``handle``; one that raises is logged, the next ones still run."""
    for fn in fns:
        try:
            fn(handle)
        except Exception:
            log.exception(
                "a done-callback of the publish of version %d raised; ignored",
                handle.result.version,
            )


class Delivery:
    """One version on its way to every subscriber: who has no outcome yet (``pending``), the
    transfers still reading the publisher's tensors for it (``reading``, per subscriber), the
    result, its deadline, the waiters and the done-callbacks. The publisher settles it, under its
    own lock or not; ``cond`` guards the rest. Users see it through its :class:`PublishHandle`.

    Rules: it is done once every subscriber has an outcome and no transfer of it reads the
    tensors any more, so that the trainer may change them as soon as it is done (a write still
    in flight would carry the next version's bytes under this version's number). A subscriber
    settled otherwise than ``done`` has its transfers given up at once (``transport.contract.
    give_up``: no notification of them follows), and the version is done once they ended.
    Callbacks run once, when it is done, never under a lock of ours: handed to ``dispatch``
    (the publisher's :class:`Callbacks`), or without one on the thread that ended it, outside
    ``cond``."""

    def __init__(
        self,
        version: int,
        names: list[str],
        deadline: float,
        dispatch: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.result = PublishResult(version)
        self.deadline = deadline
        self.pending = set(names)
        self.reading: dict[str, list[Handle]] = {}  # subscriber -> transfers that read the tensors
        self.cond = threading.Condition()
        self.callbacks: list[Callable[[PublishHandle], Any]] = []
        self.error: ClosedError | None = None  # set when the publisher closed before the end
        self.handle = PublishHandle(self)
        self._dispatch = dispatch

    def time_left(self) -> float:
        """Seconds to the version's deadline; TransferTimeout once it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("the deadline of the version passed")
        return left

    def _call(self, callbacks: list[Callable[[PublishHandle], Any]]) -> None:
        if not callbacks:
            return
        run = functools.partial(run_callbacks, self.handle, callbacks)
        if self._dispatch is None:
            run()
        else:
            self._dispatch(run)

    def track(self, name: str, h: Handle) -> None:
        """``h`` reads the publisher's tensors for ``name``: the version is not done before it
        ended (given up at once if ``name`` has an outcome already)."""
        with self.cond:
            settled = name not in self.pending
            if not settled:
                self.reading.setdefault(name, []).append(h)
        if settled:
            give_up(h, f"{name} has its outcome of version {self.result.version}")
            return
        h.add_done_callback(functools.partial(self._read_ended, name))

    def _read_ended(self, name: str, h: Handle) -> None:
        with self.cond:
            left = [r for r in self.reading.get(name, ()) if r is not h]
            if left:
                self.reading[name] = left
            else:
                self.reading.pop(name, None)
            self.cond.notify_all()
            if self.pending or self.reading:
                return
            callbacks, self.callbacks = self.callbacks, []
        self._call(callbacks)

    def settle(self, name: str, status: str, reason: str = "") -> None:
        """``name``'s outcome (the first one counts); not ``done``: its transfers are given up."""
        with self.cond:
            if name not in self.pending:
                return
            self.pending.discard(name)
            self.result.status[name] = status
            if reason:
                self.result.reasons[name] = reason
            self.cond.notify_all()
            reads = list(self.reading.get(name, ())) if status != DONE else []
            ended = not self.pending and not self.reading
            callbacks: list[Callable[[PublishHandle], Any]] = []
            if ended:
                callbacks, self.callbacks = self.callbacks, []
        for h in reads:
            give_up(h, f"{name} was {status} from version {self.result.version}: {reason}"[:300])
        self._call(callbacks)

    def close(self, error: ClosedError) -> None:
        """The publisher closed: whoever has no outcome yet never gets one; the handle completes
        now, failed with ``error`` (unless every subscriber already had an outcome)."""
        with self.cond:
            reads = [h for hs in self.reading.values() for h in hs]
            self.reading = {}
            if not self.pending:
                callbacks, self.callbacks = self.callbacks, []
            else:
                self.error = error
                for name in self.pending:
                    self.result.reasons.setdefault(name, str(error))
                self.pending = set()
                callbacks, self.callbacks = self.callbacks, []
            self.cond.notify_all()
        for h in reads:
            give_up(h, "the publisher closed")
        self._call(callbacks)

    def waits_for(self, name: str) -> bool:
        """Whether ``name`` has no outcome yet."""
        with self.cond:
            return name in self.pending

    def done(self) -> bool:
        return not self.pending and not self.reading


def close_all(deliveries: list[Delivery], error: ClosedError) -> None:
    """A publisher closed: each of ``deliveries`` completes now, failed with ``error``."""
    for d in deliveries:
        d.close(error)


class PublishHandle:
    """The result of :meth:`WeightPublisher.publish`; completes when every subscriber has an outcome
    (at the latest at the publish deadline), or when the publisher closes first: then
    :meth:`wait` raises ClosedError and :meth:`exception` returns it."""

    def __init__(self, delivery: Delivery) -> None:
        self._delivery = delivery

    @property
    def result(self) -> PublishResult:
        """Each subscriber's outcome so far (complete once :meth:`done`)."""
        return self._delivery.result

    @property
    def deadline(self) -> float:
        """When the publish gives up on the subscribers still without an outcome
        (``time.monotonic()``)."""
        return self._delivery.deadline

    def add_done_callback(self, fn: Callable[[PublishHandle], Any]) -> None:
        """Call ``fn(handle)`` once every subscriber has an outcome: on the publisher's callback
        thread, in completion order (here and now if they have one already). ``fn`` may call the
        publisher (publish, wait for another version); if it raises, that is logged and changes
        nothing else."""
        d = self._delivery
        with d.cond:
            if not d.done():
                d.callbacks.append(fn)
                return
        run_callbacks(self, [fn])

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """ClosedError if the publisher closed before every subscriber had an outcome; else None
        (a publish does not fail as a whole: :attr:`result` tells each subscriber's outcome)."""
        try:
            self.wait(timeout)
        except ClosedError as e:
            return e
        return None

    def done(self) -> bool:
        return self._delivery.done()

    def wait(self, timeout: float | None = None) -> PublishResult:
        """The result, once every subscriber has an outcome. TransferTimeout if ``timeout`` ends first."""
        d = self._delivery
        end = None if timeout is None else time.monotonic() + timeout
        with d.cond:
            while not d.done():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(
                        f"version {d.result.version} is still in flight to "
                        f"{sorted(d.pending | set(d.reading))}"
                    )
                d.cond.wait(0.05 if left is None else min(left, 0.05))
            if d.error is not None:
                raise d.error
        return d.result


class Landing:
    """The writes of one version to one subscriber: how many are still in flight (and the
    posting itself) and the first error; finished once all were posted and every one landed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 1  # the posting
        self._error: BaseException | None = None

    def posting(self) -> None:
        with self._lock:
            self._left += 1

    def landed(self, error: BaseException | None) -> tuple[bool, BaseException | None]:
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            return self._left == 0, self._error
