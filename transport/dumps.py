"""Flight-recorder dumps of one Transport: on demand, after errors, on request, on SIGUSR1."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from transport.shared_state import SharedState
from transport.store.counters import Counter
from transport.trace import ENV_DIR as TRACE_ENV_DIR

log = logging.getLogger(__name__)

#: automatic dumps after errors: at most one per this many seconds per Transport
DUMP_MIN_INTERVAL = 5.0

_sigusr1_lock = threading.Lock()
_sigusr1_dumps: weakref.WeakSet[Dumps] = weakref.WeakSet()
_sigusr1_previous: Any = None


class Dumps:
    """When and where one Transport writes its flight recorder's ring.

    It owns the trace directory (``trace_dir=``, else ``$TRANSPORT_TRACE_DIR``, else none: then
    only :meth:`dump` with a directory writes), the pending reason and the namespace's request
    counter. Rules: :meth:`request` and :meth:`on_transfer_error` only set a flag and wake the
    housekeeping thread, which writes (:meth:`run`), so they are safe from a signal handler or the
    engine thread; after a transfer error it writes at most once per ``DUMP_MIN_INTERVAL`` and
    asks every peer of the namespace to write too (a counter in the store that each peer's
    housekeeping reads, :meth:`check_requests`). Garbage in that counter is only ignored by
    readers (a reader that repaired it would make every peer dump); a Transport that asks for
    dumps repairs it to the clock in milliseconds, which is above every count seen before, so
    every peer answers that request.
    """

    def __init__(
        self, ep: SharedState, trace_dir: str | os.PathLike[str] | None, inline: Any
    ) -> None:
        self._ep = ep
        env_dir = os.environ.get(TRACE_ENV_DIR)
        self.trace_dir = Path(trace_dir) if trace_dir else (Path(env_dir) if env_dir else None)
        self._inline = inline  # counts the transfers that completed inside their post
        self._reason: str | None = None
        self._seen = 0
        self._last = 0.0
        self._requests = Counter(
            ep.store, f"transport/{ep.namespace}/trace/requests", "the namespace's dump requests"
        )
        ep.recorder.on_error = self.on_transfer_error

    def start(self) -> None:
        """Answer only newer requests of the namespace; watch SIGUSR1 (with a directory)."""
        if self.trace_dir is not None:
            self._seen = self._requests.read() or 0  # None: garbage, answered once repaired
            _watch_sigusr1(self)

    def dump(self, directory: str | os.PathLike[str] | None, reason: str) -> Path:
        d = directory if directory is not None else self.trace_dir
        if d is None:
            raise ValueError(
                f"no directory: pass one, or give Transport(trace_dir=...) or ${TRACE_ENV_DIR}"
            )
        return self._ep.recorder.dump(d, self._header(reason))

    def _header(self, reason: str) -> dict[str, Any]:
        ep = self._ep
        return {
            "name": ep.name,
            "generation": ep.generation,
            "namespace": ep.namespace,
            "reason": reason,
            "inline_completed": self._inline(),
        }

    def on_transfer_error(self, kind: str) -> None:
        """A transfer failed (any thread, often the engine's): dump, and ask the namespace to."""
        if self.trace_dir is not None and self._reason is None:
            self._reason = f"a transfer ended with a {kind}"
            self._ep.wake.set()

    def request(self, reason: str) -> None:
        """From a signal handler: only a flag and a wake-up."""
        self._reason = reason
        self._ep.wake.set()

    def write_soon(self, reason: str) -> None:
        """Write a dump from a thread of its own, now (an open Transport only): SIGUSR1's, which
        must not wait behind housekeeping that a store which cannot be reached holds up."""
        if self._ep.open:
            threading.Thread(
                target=self._to_dir, args=(reason,), name="transport-dump", daemon=True
            ).start()

    @property
    def pending(self) -> bool:
        return self._reason is not None

    def run(self) -> None:
        """Housekeeping: write the dump asked for, if any."""
        if self._reason is None:
            return
        reason, self._reason = self._reason, None
        if reason.startswith("a transfer"):
            if time.monotonic() - self._last < DUMP_MIN_INTERVAL:
                return  # one error storm, one round of dumps
            try:
                self._seen = self._requests.add(1)
            except Exception as e:
                log.warning(
                    "transport %s: could not ask the namespace to dump: %s", self._ep.name, e
                )
        self._to_dir(reason)

    def check_requests(self) -> None:
        """Housekeeping: write a dump if a peer of the namespace asked since we last looked."""
        if self.trace_dir is None:
            return
        requested = self._requests.read()
        if requested is not None and requested > self._seen:
            self._seen = requested
            self._to_dir("a peer of the namespace asked (it saw an error)")

    def _to_dir(self, reason: str) -> None:
        if self.trace_dir is None:
            return
        self._last = time.monotonic()
        name = self._ep.name
        try:
            path = self._ep.recorder.dump(self.trace_dir, self._header(reason))
        except OSError as e:
            log.warning("transport %s: could not write its trace: %s", name, e)
            return
        log.info("transport %s: trace written to %s (%s)", name, path, reason)


def _watch_sigusr1(d: Dumps) -> None:
    """SIGUSR1 dumps the ring of every Transport of the process that has a trace directory. The
    handler is installed once, from the main thread (elsewhere Python refuses; the Transport then
    dumps on errors and requests only), and calls the handler that was there before."""
    global _sigusr1_previous
    with _sigusr1_lock:
        _sigusr1_dumps.add(d)
        if (
            _sigusr1_previous is not None
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        try:
            _sigusr1_previous = signal.signal(signal.SIGUSR1, _on_sigusr1)
        except (ValueError, OSError) as e:
            log.info("SIGUSR1 is not watched: %s", e)


def _on_sigusr1(signum: int, frame: Any) -> None:
    for d in list(_sigusr1_dumps):
        d.write_soon("SIGUSR1")  # a closed Transport writes nothing
    prev = _sigusr1_previous
    if callable(prev) and prev not in (signal.SIG_IGN, signal.SIG_DFL):
        prev(signum, frame)
