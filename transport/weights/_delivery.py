"""What becomes of one published version: the publisher's record of it (``Delivery``), the
users' view of it (:class:`PublishHandle`) and its outcome per subscriber (:class:`PublishResult`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transport.errors import ClosedError, TransferTimeout

DONE, EXCLUDED, LOST = "done", "excluded", "lost"


@dataclass
class PublishResult:
    """What became of one version at each subscriber: ``done``, ``excluded`` (too slow, or its
    tensors do not match) or ``lost`` (it went away). ``reasons`` explains the last two."""

    version: int
    status: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    #: subscribers a relay was asked to serve -> that relay (the others were written directly)
    via: dict[str, str] = field(default_factory=dict)

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


class Delivery:
    """One version on its way to every subscriber: who has no outcome yet (``pending``), the
    result, its deadline, the waiters and the done-callbacks. The publisher settles it, under its
    own lock or not; ``cond`` guards the rest; callbacks run once, on the thread that settled the
    last subscriber, outside the lock. Users see it through its :class:`PublishHandle`."""

    def __init__(self, version: int, names: list[str], deadline: float) -> None:
        self.result = PublishResult(version)
        self.deadline = deadline
        self.pending = set(names)
        self.cond = threading.Condition()
        self.callbacks: list[Callable[[PublishHandle], Any]] = []
        self.error: ClosedError | None = None  # set when the publisher closed before the end
        self.handle = PublishHandle(self)

    def settle(self, name: str, status: str, reason: str = "") -> None:
        """``name``'s outcome (the first one counts)."""
        with self.cond:
            if name not in self.pending:
                return
            self.pending.discard(name)
            self.result.status[name] = status
            if reason:
                self.result.reasons[name] = reason
            self.cond.notify_all()
            callbacks = [] if self.pending else self.callbacks
            self.callbacks = []
        for fn in callbacks:
            fn(self.handle)

    def close(self, error: ClosedError) -> None:
        """The publisher closed: whoever has no outcome yet never gets one; the handle completes
        now, failed with ``error`` (unless every subscriber already had an outcome)."""
        with self.cond:
            if not self.pending:
                return
            self.error = error
            for name in self.pending:
                self.result.reasons.setdefault(name, str(error))
            self.pending = set()
            self.cond.notify_all()
            callbacks, self.callbacks = self.callbacks, []
        for fn in callbacks:
            fn(self.handle)

    def done(self) -> bool:
        return not self.pending


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
        """Call ``fn(handle)`` once every subscriber has an outcome (at once if they have)."""
        d = self._delivery
        with d.cond:
            if d.pending:
                d.callbacks.append(fn)
                return
        fn(self)

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
            while d.pending:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(
                        f"version {d.result.version} is still in flight to {sorted(d.pending)}"
                    )
                d.cond.wait(0.05 if left is None else min(left, 0.05))
            if d.error is not None:
                raise d.error
        return d.result
