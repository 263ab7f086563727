"""The thread each publisher and subscriber runs its work on, off the engine thread, and how much
of that work a peer can make wait there."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)

#: the most pieces of work that peers' messages may have waiting on one worker
MAX_OFFERED = 4096
#: how often (seconds) a worker with an end condition looks at it while idle
UNTIL_EVERY = 0.5


class Worker:
    """One thread that runs the layer's work off the engine thread (sends, callbacks), and a
    periodic ``tick`` for deadlines: the first right away, the next when the tick says (or after
    the next piece of work), so a layer that never gets work still ticks.

    The queue is bounded where peers fill it. Three ways in:

    * :meth:`submit`: this side's own work (what its transfers, versions and callers cause,
      bounded by them); never dropped.
    * :meth:`latest`: work a peer's message asks for that only needs the newest message of its
      ``key`` (a subscriber's credits, a credit to send: each says the whole current state). It
      is queued once per key; a message for a key already queued replaces the value the work
      will read. Nothing is lost, and a flood costs one queued piece per key.
    * :meth:`offer`: other work a peer's message asks for. While ``limit`` offered pieces (and
      keys) wait, more are dropped: counted in :attr:`dropped` and logged (the 1st, 2nd, 4th,
      ... time). A caller offers only work whose loss the protocol survives, and says how.

    Honest peers stay far below the limit (a version costs a handful of messages); only a peer
    that floods reaches it. With ``until``, the thread also ends by itself once ``until()`` is
    true (looked at after each piece of work and every :data:`UNTIL_EVERY` seconds idle): a
    member whose Transport was closed without closing it leaves no thread behind.
    """

    def __init__(
        self,
        name: str,
        tick: Callable[[], float | None] | None = None,
        limit: int = MAX_OFFERED,
        until: Callable[[], bool] | None = None,
    ) -> None:
        self._q: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._tick = tick
        self._until = until  # the thread ends once it is true (its Transport closed)
        self._limit = limit
        self._lock = threading.Lock()
        self._offered = 0  # offered pieces waiting
        self._latest: dict[Hashable, Any] = {}  # key -> the value its queued work will read
        self.dropped = 0
        self._name = name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        self._q.put(fn)

    def offer(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn`` unless ``limit`` offered pieces wait (then it is dropped: False)."""
        with self._lock:
            if self._offered + len(self._latest) >= self._limit:
                self._drop()
                return False
            self._offered += 1
        self._q.put(lambda: self._run_offered(fn))
        return True

    def latest(self, key: Hashable, value: Any, fn: Callable[[Any], Any]) -> None:
        """Run ``fn(newest value of key)`` once, soon: queued unless work of ``key`` waits
        already (then that work reads ``value``)."""
        with self._lock:
            if key in self._latest:
                self._latest[key] = value
                return
            if self._offered + len(self._latest) >= self._limit:
                self._drop()
                return
            self._latest[key] = value
        self._q.put(lambda: fn(self._take(key)))

    def _take(self, key: Hashable) -> Any:
        with self._lock:  # a message of the key from now on queues the work again
            return self._latest.pop(key)

    def _run_offered(self, fn: Callable[[], Any]) -> None:
        with self._lock:
            self._offered -= 1
        fn()

    def _drop(self) -> None:
        """Under the lock: count a dropped piece, log the 1st, 2nd, 4th, ... one."""
        self.dropped += 1
        if self.dropped & (self.dropped - 1) == 0:
            log.warning(
                "%s: dropped work a peer's message asked for (%d so far): %d pieces wait, the "
                "most peers' messages may queue (a peer floods us?)",
                self._name,
                self.dropped,
                self._limit,
            )

    def _run(self) -> None:
        wait: float | None = None if self._tick is None else 0.0
        while True:
            if self._until is not None:
                if self._until():
                    return  # nothing of ours runs on a closed Transport
                wait = UNTIL_EVERY if wait is None else min(wait, UNTIL_EVERY)
            try:
                fn = self._q.get(timeout=wait)
            except queue.Empty:
                fn = None
            else:
                if fn is None:
                    return
                try:
                    fn()
                except Exception:
                    log.exception("weight-sync work failed")
            if self._tick is not None:
                try:
                    wait = self._tick()
                except Exception:
                    log.exception("weight-sync deadline check failed")
                    wait = 0.1

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
