"""The proxy thread of stream-ordered transfers: it watches doorbells and posts prepared transfers.

Each stream-ordered operation (a put, a get, a publish) owns a :class:`Slot`: four 64-bit words
in memory that both the host and the GPU see (pinned, mapped host memory), plus a sequence counter
that the ring kernel increments, in the same kind of memory (see ``csrc/stream_ops.cu``):

* ``bell``: the newest sequence number the stream asked for (the ring kernel writes it)
* ``done``: the newest one that ended (the proxy writes it; the wait kernel waits for it)
* ``failed``: the newest one that ended in an error (the proxy writes it)
* ``gave_up``: the newest one a wait kernel stopped waiting for at its timeout (the kernel)

The proxy never runs inside a CUDA callback and makes no CUDA call: it reads the bells, calls
the slot's ``start`` (which posts the transfer through the Transport, as a put from the host
would) and, when the transfer ends, writes ``done`` (and ``failed``). An error is kept and raised
at the next host-side check (a handle's ``wait``, the next put, ``Transport.check()``); the stream
is released all the same, so it never hangs and the process never exits.

Rings that come faster than transfers end are coalesced: one transfer, started after the newest
ring, reads the source as it is then and answers them all. The words live in one array of fixed
capacity, so replaying a graph 10,000 times allocates nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from transport.errors import TransferTimeout, TransportError

log = logging.getLogger(__name__)

BELL, DONE, FAILED, GAVE_UP = range(4)
#: ``done`` of every slot once the proxy closed: past any sequence number a stream will ring
RELEASED = 1 << 62


class Slot:
    """One stream-ordered operation: its words, what it starts, and its bookkeeping."""

    def __init__(self, index: int, start: Callable[[], Any], what: str, captured: bool) -> None:
        self.index = index
        self.start = start  # posts the transfer; returns something with add_done_callback()
        self.what = what
        self.captured = captured
        self.seen = 0  # the newest ring acted upon
        self.inflight = False
        self.rings = 0  # eager rings issued by the host (the expected sequence numbers)
        self.errors = 0
        self.last_error: BaseException | None = None


class Proxy:
    """Watches the bells of every slot from one thread; ``words`` is a (capacity, 4) int64 tensor
    (pinned with CUDA; any CPU tensor when a test rings the bells itself)."""

    def __init__(
        self, words: torch.Tensor, name: str = "transport-stream-proxy", idle: float = 1e-3
    ) -> None:
        if words.dtype != torch.int64 or words.dim() != 2 or words.shape[1] != 4:
            raise ValueError("the doorbell words must be an int64 tensor of shape (capacity, 4)")
        self.words = words
        self.capacity = words.shape[0]
        self.slots: list[Slot] = []
        self._lock = threading.Lock()
        self._errors: deque[BaseException] = deque(maxlen=64)
        self._reported_gave_up: dict[int, int] = {}
        self._idle = idle
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- slots -----------------------------------------------------------------------------------

    def add(self, start: Callable[[], Any], what: str, captured: bool = False) -> Slot:
        with self._lock:
            if len(self.slots) >= self.capacity:
                raise TransportError(
                    f"no free stream slot: at most {self.capacity} stream-ordered operations per "
                    "Transport; the same put on the same stream reuses its slot, so issue the "
                    "same puts (same tensors, peer and keys) rather than new ones every step"
                )
            slot = Slot(len(self.slots), start, what, captured)
            self.words[slot.index].zero_()
            self.slots.append(slot)
        self._wake.set()
        return slot

    def word(self, slot: Slot, which: int) -> int:
        return int(self.words[slot.index, which])

    # -- errors ----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the oldest error not raised yet (a failed transfer, or a stream that gave up)."""
        self._collect_gave_up()
        with self._lock:
            if self._errors:
                raise self._errors.popleft()

    def _collect_gave_up(self) -> None:
        with self._lock:
            slots = list(self.slots)
        for s in slots:
            g = self.word(s, GAVE_UP)
            if g and self._reported_gave_up.get(s.index, 0) < g:
                self._reported_gave_up[s.index] = g
                with self._lock:
                    self._errors.append(
                        TransferTimeout(
                            f"a stream stopped waiting for {s.what} (request {g}) at its timeout: "
                            "the transfer did not end in time; later work on the stream ran "
                            "without its data"
                        )
                    )

    # -- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self._idle
        while not self._stop:
            busy = self._poll()
            interval = 2e-05 if busy else min(self._idle, interval * 2)
            if self._wake.wait(interval):
                self._wake.clear()
                interval = 20e-6

    def _poll(self) -> bool:
        with self._lock:
            slots = list(self.slots)
        if not slots:
            return False
        bells = self.words[: len(slots), BELL].tolist()
        busy = False
        for slot, bell in zip(slots, bells, strict=True):
            if slot.inflight:
                busy = True
            elif bell > slot.seen:
                busy = True
                self._start(slot, bell)
        return busy

    def _start(self, slot: Slot, bell: int) -> None:
        slot.seen, slot.inflight = bell, True
        try:
            h = slot.start()
        except BaseException as e:
            self._ended(slot, bell, e)
            return
        h.add_done_callback(lambda h: self._ended(slot, bell, h.exception(0)))

    def _ended(self, slot: Slot, bell: int, err: BaseException | None) -> None:
        """The transfer answering every ring up to ``bell`` ended: release the stream."""
        if err is not None:
            slot.errors += 1
            slot.last_error = err
            with self._lock:
                self._errors.append(err)
            self.words[slot.index, FAILED] = bell
            log.warning("stream-ordered %s failed: %s", slot.what, err)
        self.words[slot.index, DONE] = bell
        slot.inflight = False
        self._wake.set()

    def wait_done(self, slot: Slot, seq: int, timeout: float | None) -> None:
        """Host side: block until request ``seq`` of ``slot`` ended; raise its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 20e-6
        while self.word(slot, DONE) < seq:
            if deadline is not None and time.monotonic() > deadline:
                raise TransferTimeout(
                    f"{slot.what}: request {seq} did not end within {timeout:.3g} s (the stream "
                    "may not have reached it yet)"
                )
            if self._stop:
                raise TransportError("the Transport was closed")
            threading.Event().wait(delay)
            delay = min(delay * 2, 1e-3)
        if self.word(slot, FAILED) >= seq:
            err = slot.last_error or TransportError(f"{slot.what}: request {seq} failed")
            with self._lock:
                if err in self._errors:
                    self._errors.remove(err)  # raised here, not again at the next check
            raise err

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        # release every stream that still waits, and every later ring of a graph replayed after
        # the close (its counter keeps counting): nothing more will be posted
        for s in self.slots:
            if self.word(s, DONE) < self.word(s, BELL):
                self.words[s.index, FAILED] = RELEASED
            self.words[s.index, DONE] = RELEASED
