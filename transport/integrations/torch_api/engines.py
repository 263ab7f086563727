"""The engines that the torch-API endpoints of one process share.

torch's NIXL backend gives every endpoint an agent of its own, and each endpoint has one peer:
a process that talks to 8 peers holds 8 agents and 8 progress threads. Here every endpoint
made with the same engine options uses one :class:`SharedEngine`: one ``transport.Transport``
(one NIXL agent, its lanes for large host copies, one engine thread that sleeps when idle,
deadlines on every transfer), however many endpoints and peers.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from dataclasses import dataclass

import torch

from transport import Transport, TransportError
from transport.contract import PeerView
from transport.store import MemoryStore

log = logging.getLogger(__name__)

#: the control channel between engines (transport/contract.py): "bye GENERATION" at close
CHANNEL = "torch-api"
#: how long a closing engine waits for its peers to confirm that they heard it leave
BYE_WAIT_S = 2.0


@dataclass(frozen=True)
class EngineOptions:
    """What shapes an engine (endpoints with equal options share one): the ``namespace`` and
    ``secret`` its records are sealed for (both ends must agree), and its lanes and memory
    budget (``transport.Transport``'s options of those names)."""

    namespace: str = "torch"
    secret: bytes | None = None
    lanes: int | None = None
    lane_bytes: int | None = None  # None: the Transport's default
    max_registered_bytes: int | None = None


class SharedEngine:
    """One Transport serving the endpoints of this process that share its options.

    It owns the Transport (on a store of its own in this process: its record, and the records
    of the peers admitted from URLs and descriptors, since torch's API hands those between
    processes itself), the tensors of the regions exposed through it (so that two endpoints of
    this process copy between each other directly) and the count of endpoints that use it.

    Rules: :func:`acquire` hands it out and :meth:`release` gives it back; the last release
    closes the Transport. Region names are unique for the engine's life. Thread-safe.
    """

    def __init__(self, options: EngineOptions, key: EngineOptions | None) -> None:
        self.options = options
        self._key = key  # None: private to one endpoint
        name = f"torch-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.transport = Transport(
            name,
            store=MemoryStore(None),
            namespace=options.namespace,
            secret=options.secret,
            lanes=options.lanes,
            lane_bytes=options.lane_bytes,
            max_registered_bytes=options.max_registered_bytes,
        )
        self.name = name
        self.generation = self.transport.generation
        self.users = 0
        self._regions: dict[str, torch.Tensor] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self._peers: set[str] = set()  # every peer admitted: told when this engine closes
        self._unheard: set[str] = set()  # told, and not confirmed yet
        self._all_heard = threading.Event()
        self.transport.core.on_control(CHANNEL, self._on_control)

    def admit(self, record: bytes) -> PeerView:
        """Connect to the peer whose (sealed) record ``record`` is; what the connection shows."""
        view = self.transport.core.admit(record)
        with self._lock:
            self._peers.add(view.name)
        return view

    def _on_control(self, peer: str, payload: bytes) -> None:
        """Engine thread: a peer engine closes ("bye GENERATION": answered, then that peer is
        forgotten, on a thread of its own) or confirms that it heard ours ("heard")."""
        kind, _, generation = payload.partition(b" ")
        if kind == b"heard":
            with self._lock:
                self._unheard.discard(peer)
                if not self._unheard:
                    self._all_heard.set()
            return
        if kind != b"bye" or not generation.isdigit():
            log.warning("dropping a message of %d bytes from %s: not a bye", len(payload), peer)
            return
        threading.Thread(
            target=self._forget,
            args=(peer, int(generation)),
            name=f"torch-api-bye-{peer}",
            daemon=True,
        ).start()

    def _forget(self, peer: str, generation: int) -> None:
        core = self.transport.core
        try:
            core.send_control(peer, CHANNEL, b"heard")
        except TransportError as e:
            log.debug("could not confirm to %s that it left: %s", peer, e)
        with self._lock:
            self._peers.discard(peer)
        core.forget(peer, generation)

    def expose(self, tensor: torch.Tensor) -> str:
        """Expose ``tensor`` (bytes, contiguous) under a new region name; returns the name."""
        with self._lock:
            region = f"m{next(self._numbers)}"
        self.transport.expose(region, tensor, access="rw")
        with self._lock:
            self._regions[region] = tensor
        return region

    def withdraw(self, regions: list[str], timeout: float) -> None:
        """Withdraw ``regions``: their descriptors no longer reach them, and the memory is the
        caller's again."""
        if not regions:
            return
        with self._lock:
            for region in regions:
                self._regions.pop(region, None)
        if not self.transport.closed:
            self.transport.unexpose(regions, timeout=max(timeout, 1e-3))

    def local(self, region: str) -> torch.Tensor | None:
        """The tensor of one of our own regions (None once withdrawn)."""
        with self._lock:
            return self._regions.get(region)

    def release(self) -> None:
        """An endpoint is done with the engine; the last one closes it."""
        with _lock:
            self.users -= 1
            last = self.users == 0
            if last and self._key is not None and _engines.get(self._key) is self:
                del _engines[self._key]
        if last:
            self._say_bye()
            self.transport.close()

    def _say_bye(self) -> None:
        """Tell every admitted peer that this engine closes, so that none of them waits for it,
        and wait (at most BYE_WAIT_S) until each confirmed: a message still queued when the
        agent goes is lost."""
        with self._lock:
            peers = sorted(self._peers)
            self._unheard = set(peers)
            self._all_heard.clear()
        bye = b"bye %d" % self.generation
        for peer in peers:
            try:
                self.transport.core.send_control(peer, CHANNEL, bye)
            except TransportError as e:
                log.debug("could not tell %s that %s closes: %s", peer, self.name, e)
                with self._lock:
                    self._unheard.discard(peer)
        with self._lock:
            if not self._unheard:
                return
        self._all_heard.wait(BYE_WAIT_S)


_engines: dict[EngineOptions, SharedEngine] = {}
_lock = threading.Lock()


def acquire(options: EngineOptions, *, private: bool = False) -> SharedEngine:
    """The engine of ``options`` (made on first use), or a new one of its own for ``private``."""
    with _lock:
        engine = None if private else _engines.get(options)
        if engine is None or engine.transport.closed:
            engine = SharedEngine(options, None if private else options)
            if not private:
                _engines[options] = engine
            log.info("torch API engine %s started (%s)", engine.name, options.namespace)
        engine.users += 1
        return engine
