"""An engine's bucket-protocol messages as they arrive, and waiting on them with an eye on peers.

The :class:`Inbox` owns the control channel ``verl/buckets`` of one Transport. Its handler runs
on the Transport's engine thread and only files messages (a message that breaks a rule, or that
belongs to another update, is logged and dropped: no frame stops the engine). The one thread that
drives an update calls :meth:`Inbox.wait` with a condition over what was filed; while it waits, it
reads the heartbeat of each peer it depends on every :data:`WATCH_INTERVAL` seconds, so a peer
that died or froze ends the wait in seconds (:class:`PeerGone`) instead of at the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from transport import Transport
from transport.errors import PeerNotFoundError, TransferTimeout, TransportError, WireFormatError
from transport.weights.buckets.messages import CHANNEL, Abort, Bucket, Free, decode

log = logging.getLogger("transport.verl")

#: how often a waiting engine reads the heartbeats of the peers it depends on
WATCH_INTERVAL = 1.0
T = TypeVar("T")


class PeerGone(TransportError):
    """A peer an update depends on is suspect (dead, frozen, partitioned) or left the store."""

    def __init__(self, peer: str, why: str) -> None:
        super().__init__(f"peer {peer} is gone: {why}")
        self.peer = peer
        self.why = why


class Inbox:
    """The messages of the current update, filed by kind (see the module docstring).

    Rules: :meth:`begin` starts an update (what an earlier one left is dropped); one thread at a
    time waits; :meth:`close` stops listening and wakes that thread."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._cond = threading.Condition()
        self._token: str | None = None
        self.buckets: dict[tuple[str, int], Bucket] = {}
        self.free: dict[str, int] = {}
        self.aborts: list[tuple[str, Abort]] = []
        self._generations: dict[str, int] = {}
        self._closed = False
        self._stop = transport.core.on_control(CHANNEL, self._on_message)

    def begin(self, token: str) -> None:
        with self._cond:
            self._token = token
            self.buckets.clear()
            self.free.clear()
            self.aborts.clear()
            self._generations.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._stop()

    def _on_message(self, peer: str, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except WireFormatError as e:
            log.warning("dropping a bucket-protocol message from %s: %s", peer, e)
            return
        with self._cond:
            if msg.token != self._token:
                log.debug("dropping a message of another update from %s: %s", peer, msg)
                return
            if isinstance(msg, Bucket):
                self.buckets.setdefault((peer, msg.index), msg)
            elif isinstance(msg, Free):
                self.free[peer] = max(self.free.get(peer, -1), msg.index)
            else:
                self.aborts.append((peer, msg))
            self._cond.notify_all()

    def may_write(self, peer: str, index: int) -> bool:
        """Whether ``peer`` freed its slot for bucket ``index`` (slots start free)."""
        return index < 2 or self.free.get(peer, -1) >= index

    def _check(self, watch: Iterable[str]) -> None:
        core = self.transport.core
        for peer in watch:
            try:
                gen = self._generations.get(peer)
                if gen is None:
                    gen = self._generations[peer] = core.peer(peer).generation
                why = core.suspect(peer, gen)
            except PeerNotFoundError:
                why = "it left the store (its record is gone)"
            except TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                raise PeerGone(peer, why)

    def wait(
        self,
        ready: Callable[[], T | None],
        *,
        watch: Callable[[], Iterable[str]],
        timeout: float,
        what: str,
    ) -> T:
        """Return ``ready()`` (called under the inbox's lock) once it is not None. PeerGone when a
        peer of ``watch()`` is gone; TransferTimeout naming ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + WATCH_INTERVAL
        core = self.transport.core
        core.waiting(1)
        try:
            while True:
                with self._cond:
                    if self._closed:
                        raise TransportError(f"the engine closed while waiting for {what}")
                    value = ready()
                    if value is not None:
                        return value
                    now = time.monotonic()
                    if now >= deadline:
                        raise TransferTimeout(
                            f"no {what} within {timeout:g} s; raise engine_kwargs.transport."
                            "timeout if the trainer needs longer between buckets"
                        )
                    if now < next_check:
                        self._cond.wait(min(deadline, next_check) - now)
                        continue
                next_check = time.monotonic() + WATCH_INTERVAL
                self._check(watch())
        finally:
            core.waiting(-1)
