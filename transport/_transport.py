"""The Transport: one process's endpoint, a facade over its parts.

Each job lives in a part of its own, wired here and sharing one :class:`SharedState`:

* ``memory/regions.py``: the memory we expose and register, our peer record, withdrawal;
* ``peers/table.py``: connections to peers (connect, refresh, drop, restarts);
* ``peers/admission.py``: peers met out of band (records handed over by a layer, leaves said);
* ``transfers/plan_cache.py``: prepared transfers, cached;
* ``transfers/paths.py``: the transfer paths (fast path, fan-out, general path, lanes, streams,
  retries);
* ``control.py``: notifications and the library's control messages;
* ``housekeeping.py``: the background thread (heartbeats, retries, withdrawals, dumps);
* ``dumps.py``: flight-recorder dumps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import transport.backends as _backends
from transport._closing import Closing
from transport._version import __version__
from transport.at_exit import close_at_exit
from transport.backends.base import READ, WRITE
from transport.contract import CoreLink
from transport.control import ControlChannel, Notification
from transport.doorbell import Doorbell
from transport.dumps import Dumps
from transport.errors import ClosedError, PeerWaitTimeout, WireFormatError
from transport.handle import Handle
from transport.housekeeping import Housekeeping
from transport.memory.local import LocalMemory, default_budget
from transport.memory.regions import Regions
from transport.peers.admission import Admission
from transport.peers.directory import RETIRE_WAIT, Directory
from transport.peers.liveness import suspicion
from transport.peers.table import PeerInfo, PeerTable, PeerTraffic, peer_info
from transport.progress_engine import ProgressEngine
from transport.security.signed import SignedStore
from transport.settings import LANE_BYTES, Settings, check_lanes, positive
from transport.shared_state import SharedState, State
from transport.store import DEFAULT_STORE_URL, Store, store_from_url
from transport.trace import DEFAULT_CAPACITY, FlightRecorder
from transport.transfers.batch import Batch, make_batch
from transport.transfers.lanes import default_lanes
from transport.transfers.paths import Request, Transfers
from transport.transfers.plan_cache import PlanCache
from transport.wire import RegionInfo, agent_name, check_name

log = logging.getLogger(__name__)


class Transport(Closing):
    """One process's endpoint for one-sided tensor transfers.

    ``Transport(name, store=..., namespace=..., secret=...)`` joins the
    namespace under ``name``: it takes the next *generation* of that name,
    creates one backend agent, publishes a peer record and starts its engine
    thread. Use it as a context manager, or call :meth:`close`.

    Rules:

    * **Ownership.** Exposed and registered tensors are kept alive and
      registered until :meth:`close`; peers may write (``access`` "w" or "rw")
      or read ("r" or "rw") them at any time. Nothing in this library stops a
      peer from writing while you read: use notifications to agree on when.
    * **Handles.** :meth:`put` and :meth:`get` validate everything (contiguity,
      device, dtype, size, access) before any byte moves, and then return a
      :class:`Handle` at once. What is known before posting (bad input, an
      unknown or unreachable peer) is raised by the call itself; what happens
      after is raised by the handle. Do not modify a source (or read a destination)
      until its handle is done.
    * **Deadlines.** Every transfer has one (``timeout=``, default
      ``Transport(timeout=60)``): a frozen or partitioned peer fails it with
      :class:`TransferTimeout` (bytes already on their way may still land).
      ``wait(timeout)`` bounds the wait only and cancels nothing.
    * **Peers.** A peer is resolved through the store on first use and cached;
      nothing touches the store on the hot path after that. A peer that dies
      fails its transfers with :class:`PeerLostError`; one that restarts under
      the same name is picked up by the next put or get.
    * **Threads.** All methods are thread-safe. Done-callbacks run on the
      engine thread and must not wait on handles.

    Options: ``timeout`` is the default transfer deadline; transfers of more than ``chunk_bytes``
    are posted in parts of that size so that one huge post does not hold the agent for long (the
    notification follows the last part); transfers of at most ``inline_bytes`` are posted by the
    calling thread (no hand-off); ``idle_interval`` is the longest an idle engine sleeps (peers
    ring it as they send, transport/doorbell.py: it bounds what a lost ring costs);
    ``heartbeat_interval`` is how often the store hears from this peer; transfers between host
    memory of at least ``lane_bytes`` (default 8 MiB) are cut over ``lanes`` agents, each posting
    from its own thread (transfers/lanes.py; default from the CPU count, ``$TRANSPORT_LANES``; 1
    turns them off); ``max_registered_bytes`` bounds the host memory this peer registers
    (exposed, registered and cached for transfers; default three quarters of physical memory or
    ``$TRANSPORT_MAX_REGISTERED_BYTES``): past it a call fails with RegistrationBudgetError and
    registers nothing.
    """

    def __init__(
        self,
        name: str,
        store: str | Store | None = None,
        *,
        namespace: str = "default",
        secret: bytes | str | None = None,
        backend: str = "nixl",
        timeout: float = 60.0,
        chunk_bytes: int = 64 << 20,
        inline_bytes: int = 1 << 20,
        idle_interval: float = 1.0,
        heartbeat_interval: float = 1.0,
        trace_dir: str | os.PathLike[str] | None = None,
        trace_capacity: int = DEFAULT_CAPACITY,
        lanes: int | None = None,
        lane_bytes: int | None = None,
        max_registered_bytes: int | None = None,
    ) -> None:
        self.name = check_name("peer name", name)
        self.namespace = check_name("namespace", namespace)
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 8):
            raise ValueError(
                "secret must be at least 8 bytes (or a str); every peer of the namespace must share it"
            )
        if max_registered_bytes is not None and (
            not isinstance(max_registered_bytes, int) or max_registered_bytes <= 0
        ):
            raise ValueError(
                f"max_registered_bytes must be a positive int, got {max_registered_bytes!r}"
            )
        budget = default_budget() if max_registered_bytes is None else max_registered_bytes
        settings = Settings(
            timeout,
            chunk_bytes,
            inline_bytes,
            idle_interval,
            heartbeat_interval,
            default_lanes() if lanes is None else check_lanes(lanes),
            LANE_BYTES if lane_bytes is None else lane_bytes,
        )
        # the flight recorder; automatic dumps (errors, requests of the namespace, SIGUSR1) go to
        # trace_dir, or $TRANSPORT_TRACE_DIR, and nowhere without one
        self.recorder = FlightRecorder(trace_capacity)
        if store is None:
            store = os.environ.get("TRANSPORT_STORE", DEFAULT_STORE_URL)
        owns_store = not isinstance(store, Store)
        self.store: Store = store_from_url(store) if isinstance(store, str) else store
        if not isinstance(self.store, Store):
            raise TypeError(
                f"store must be a URL or a transport.store.Store, got {type(store).__name__}"
            )
        try:
            directory = Directory(self.store, self.namespace, secret)
            self.generation = directory.join(self.name)
            be = _backends.new_backend(backend, agent_name=agent_name(self.name, self.generation))
            doorbell = Doorbell.listen(getattr(self.store, "url", None), be)  # closes be if not
        except BaseException:
            if owns_store:
                self.store.close()
            raise
        self._owns_store = owns_store
        ep = self._ep = SharedState(
            self.name,
            self.namespace,
            self.generation,
            secret,
            be,
            backend,
            LocalMemory(be, budget=budget),
            directory,
            self.store,
            self.recorder,
            settings,
            time.time(),
        )
        self._peers = PeerTable(ep)
        self._plans = PlanCache(ep, self._peers)
        self._control = ControlChannel(ep, self._peers)
        self._regions = Regions(ep, self._control, self._peers, self._plans)
        self._transfers = Transfers(ep, self._peers, self._plans, self._regions.local_names)
        self._dumps = Dumps(ep, trace_dir, lambda: self._transfers.inline_count)
        self._housekeeping = Housekeeping(
            ep,
            self._peers,
            self._plans,
            self._regions,
            self._transfers,
            self._dumps,
            self._control,
        )
        retries = self._transfers.retries
        ep.engine = self._engine = ProgressEngine(
            be,
            self.name,
            self._control.route,
            self._peers.on_lost,
            retries.on_retry,
            idle_interval=idle_interval,
            doorbell=doorbell,
        )
        self._engine.pending = lambda: self._control.releasable
        self._engine.start()
        #: the internal contract of the library's own layers (weights/, cuda/): see contract.py
        admission = Admission(ep, self._peers)
        self.core = CoreLink(
            check_open=ep.check_open,
            peer=self._peers.connect,
            on_control=self._control.on_control,
            send_control=self._control.send_control,
            put_control=self._put_control,
            put_control_at=self._put_control_at,
            suspect=self._suspect,
            heartbeat_key=directory.heartbeat_key,
            poll_at_least=self._engine.poll_at_least,
            waiting=self._engine.waiting,
            stream_ops=self._transfers.stream_ops,
            record=admission.record,
            admit=admission.admit,
            forget=admission.forget,
            signed=SignedStore(self.store, ep.keys, self.name, self.generation),
        )
        try:
            self._regions.publish()
            directory.heartbeat(self.name, self.generation)
            self._dumps.start()
        except BaseException:
            self.close()
            raise
        close_at_exit(self)  # NIXL's threads abort an exiting process that did not close
        self._housekeeping.start()
        log.info(
            "transport %s#%d joined namespace %s on %s",
            self.name,
            self.generation,
            self.namespace,
            self.store,
        )

    # -- settings -----------------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        """The default deadline of a transfer, in seconds."""
        return self._ep.settings.timeout

    @property
    def chunk_bytes(self) -> int:
        return self._ep.settings.chunk_bytes

    @property
    def inline_bytes(self) -> int:
        return self._ep.settings.inline_bytes

    @property
    def heartbeat_interval(self) -> float:
        return self._ep.settings.heartbeat_interval

    @property
    def lane_bytes(self) -> int:
        return self._ep.settings.lane_bytes

    @property
    def lanes(self) -> int:
        """Agents a large host transfer is cut over (1: none); may change between transfers."""
        return self._ep.settings.lanes

    @lanes.setter
    def lanes(self, value: int) -> None:
        self._ep.settings.lanes = check_lanes(value)

    @property
    def max_plans(self) -> int:
        """Prepared transfers kept for replay (the least recently made go first)."""
        return self._ep.settings.max_plans

    @max_plans.setter
    def max_plans(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"max_plans must be a positive int, got {value!r}")
        self._ep.settings.max_plans = value

    @property
    def trace_dir(self) -> Path | None:
        """Where automatic flight-recorder dumps go (None: nowhere)."""
        return self._dumps.trace_dir

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ep.state is State.CLOSED

    def close(self) -> None:
        """Leave the namespace, fail transfers still in flight with ClosedError, release everything.
        Idempotent. Closing the process that hosts the embedded store stops that store.

        First no peer's transfer reaches our memory any more (``Backend.refuse_incoming``). Nothing
        of ours is written to the store after we left it: the housekeeping threads' writes of our
        record and heartbeat (and an expose's racing the close) end first (``Directory.depart``
        waits for the one in flight; each wait at most ``min(timeout, 10)`` s)."""
        ep = self._ep
        with ep.lock:
            if ep.state is State.CLOSED:
                return
            ep.state = State.CLOSED
        ep.stopping.set()
        ep.wake.set()
        ep.backend.refuse_incoming(min(ep.settings.timeout, RETIRE_WAIT))
        ep.directory.depart(self.name, self.generation, min(ep.settings.timeout, RETIRE_WAIT))
        self._transfers.stop()
        self._engine.stop()
        self._housekeeping.join(5.0)
        self._transfers.close(ClosedError("the Transport was closed before the transfer completed"))
        self._regions.close()
        self._peers.close()
        self._plans.clear()
        ep.mem.close()
        ep.backend.close()
        if self._owns_store:
            self.store.close()
        self._control.close()

    # -- exposing and registering memory ------------------------------------------------------

    def expose(self, name: str, tensor: torch.Tensor, access: str = "rw") -> RegionInfo:
        """Register ``tensor`` and publish it as region ``name`` that peers may write and/or read."""
        return self.expose_all({name: tensor}, access=access)[name]

    def expose_all(
        self, tensors: Mapping[str, torch.Tensor], access: str = "rw"
    ) -> dict[str, RegionInfo]:
        """Expose many tensors with one record update (for example ``model.state_dict()``).
        Everything is checked before anything is exposed, and it is all or nothing: when the
        store cannot take the record (StoreError), none of them is exposed."""
        return self._regions.expose_all(tensors, access)

    def unexpose(self, name: str | Sequence[str], timeout: float | None = None) -> list[str]:
        """Withdraw region ``name`` (or every region of a list of names, together): take it out
        of this peer's record, tell every peer of the namespace, wait until each has stopped
        using it and its transfers into it have ended (at most ``timeout`` seconds, default the
        Transport's), then deregister the memory. Returns the peers that did not confirm in time
        (only they may still write there; none with a timeout long enough). Afterwards puts
        into it fail with RegionError and the tensor is the caller's again. A list costs one
        record written and a few messages per peer, whatever its length; a name that is not
        exposed raises KeyError before anything is withdrawn."""
        names = [name] if isinstance(name, str) else list(name)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"region name must be a str, got {type(n).__name__}")
        if timeout is not None:
            positive("timeout", timeout)
        return self._regions.withdraw(names, self.timeout if timeout is None else timeout)

    def register(self, tensor: torch.Tensor, name: str | None = None) -> None:
        """Register ``tensor`` as a local source/destination (not visible to peers). With ``name``,
        a put or get of this tensor without ``key`` uses that remote region name."""
        self._regions.register(tensor, name)

    def regions(self) -> dict[str, RegionInfo]:
        """The regions this Transport exposes."""
        return self._regions.infos()

    # -- transfers ----------------------------------------------------------------------------

    @staticmethod
    def batch(
        tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor, int]],
    ) -> Batch:
        """``tensors`` (region name -> tensor) checked once, for puts and gets repeated every
        step: ``t.put(batch, peer)`` then costs no per-tensor work (a model of 100,000 tensors).
        A list of ``(region name, tensor, offset)`` triples instead places each tensor at its
        own offset (elements of its region), several into one region if need be: the byte runs
        of a sharded layout, one transfer. The tensors must keep their memory: update them in
        place."""
        return make_batch(tensors)

    def put(
        self,
        src: torch.Tensor | Mapping[str, torch.Tensor] | Batch,
        peer: str | Iterable[str],
        key: str | None = None,
        *,
        offset: int = 0,
        notify: bytes | None = None,
        timeout: float | None = None,
        stream: Any = None,
    ) -> Handle:
        """Write ``src`` into region ``key`` of ``peer`` (one-sided WRITE); returns a Handle at once.

        ``src`` may be a dict name -> tensor: one transfer for the whole batch, each tensor into the
        region of its name (or a :meth:`batch` of them, which may place each at its own offset). ``peer`` may be a list of names (fan-out, one handle). ``offset`` is in
        elements of the region. ``notify`` (bytes) reaches the peer after all the data has landed.
        Without ``key`` the name the source was exposed or registered under is used.
        """
        tr = self._transfers
        if type(src) is torch.Tensor and stream is None:
            if type(peer) is str:
                handle = tr.fast(
                    WRITE, src, peer, key, offset=offset, notify=notify, timeout=timeout
                )
                if handle is not None:
                    return handle
            elif isinstance(peer, (list, tuple)):
                handle = tr.fast_fanout(
                    src, peer, key, offset=offset, notify=notify, timeout=timeout
                )
                if handle is not None:
                    return handle
        request = Request(
            WRITE, src, peer, key, offset=offset, notify=notify, timeout=timeout, stream=stream
        )
        return tr.transfer(request)

    def get(
        self,
        dst: torch.Tensor | Mapping[str, torch.Tensor] | Batch,
        peer: str,
        key: str | None = None,
        *,
        offset: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> Handle:
        """Read region ``key`` of ``peer`` into ``dst`` (one-sided READ); returns a Handle at once.
        ``dst`` may be a dict name -> tensor (one transfer). The region must allow reads."""
        if not isinstance(peer, str):
            raise TypeError("get reads from one peer; pass its name as a str")
        tr = self._transfers
        if type(dst) is torch.Tensor and stream is None:
            handle = tr.fast(READ, dst, peer, key, offset=offset, notify=None, timeout=timeout)
            if handle is not None:
                return handle
        return tr.transfer(Request(READ, dst, peer, key, offset, timeout=timeout, stream=stream))

    def _put_control(
        self,
        src: Mapping[str, torch.Tensor] | Batch,
        peer: str,
        channel: str,
        payload: bytes,
        timeout: float | None,
    ) -> Handle:
        return self._transfers.control(src, peer, channel, payload, timeout=timeout)

    def _put_control_at(
        self,
        src: torch.Tensor,
        key: str,
        offset: int,
        peer: str,
        channel: str,
        payload: bytes,
        timeout: float | None,
    ) -> Handle:
        return self._transfers.control(
            src, peer, channel, payload, key=key, offset=offset, timeout=timeout
        )

    def check(self) -> None:
        """Raise the oldest error of a stream-ordered transfer not raised yet (they surface at the
        next put or get, or a handle's wait, too). Nothing to do without stream= transfers."""
        self._ep.check_open()
        if self._transfers.stream is not None:
            self._transfers.stream.check()

    # -- notifications ------------------------------------------------------------------------

    def notify(self, peer: str, payload: bytes) -> None:
        """Send a notification without data to ``peer``; it arrives after every transfer this
        Transport completed to that peer before the call."""
        self._control.notify(peer, payload)

    def notifications(self, timeout: float | None = None) -> Iterator[Notification]:
        """Yield notifications as they arrive until ``timeout`` seconds have passed (``0``: only
        those already here; ``None``: until the Transport closes)."""
        return self._control.iterate(timeout)

    @property
    def dropped_notifications(self) -> int:
        """Notifications dropped because too many were queued unread (65,536, or 64 MiB of
        payload): read them sooner, or they are lost (each drop is logged)."""
        return self._control.dropped

    @property
    def refused_notifications(self) -> int:
        """Notifications and control messages refused on receipt because their sender was not
        proven: a bad or missing MAC or a replay (with a secret), or an agent that is not the
        peer it names (without one). Each kind is logged."""
        return self._control.refused

    def wait_notification(
        self, timeout: float | None = None, peer: str | None = None
    ) -> Notification:
        """The next notification (from ``peer`` if given; others stay queued). TransferTimeout at
        the deadline, ClosedError if the Transport closes first."""
        return self._control.wait(timeout, peer)

    # -- peers --------------------------------------------------------------------------------

    def peers(self) -> list[PeerInfo]:
        """The peers of the namespace that have a record, this one included. A peer whose
        heartbeat stopped is still listed (its record stays until it leaves or restarts), with
        ``suspect`` saying why it may be gone (see :class:`PeerInfo`)."""
        directory = self._ep.directory
        interval = self._ep.settings.heartbeat_interval
        out = []
        for name in directory.names():
            try:
                rec = directory.fetch(name)
            except WireFormatError as e:
                log.warning("skipping peer %s: %s", name, e)
                continue
            if rec is not None:
                hb, heard = (
                    directory.last_heartbeat(name),
                    self._control.heard(name, rec.generation),
                )
                out.append(peer_info(rec, hb, interval, heard))
        return out

    def traffic(self) -> dict[str, PeerTraffic]:
        """Bytes this Transport's completed transfers (puts, gets, a publisher's writes) moved
        with each peer since it opened, by peer name: counted as each transfer completes, not
        planned. Notifications are not counted."""
        return self._peers.traffic_of()

    def _suspect(self, name: str, generation: int) -> str | None:
        """transport.core.suspect: one heartbeat read, judged as peers() judges it; with none of
        that incarnation, a second read says whether it closed (it left the namespace: nothing
        brings its heartbeat and record back). A stale heartbeat of an incarnation that sent us
        a frame within the same bar is not suspect (liveness.py: it answered)."""
        directory = self._ep.directory
        hb = directory.last_heartbeat(name)
        if hb is None or hb[0] < generation:
            gone = directory.left(name)
            if gone is not None and gone >= generation:
                return f"it closed (generation {gone} left the namespace)"
        interval = self._ep.settings.heartbeat_interval
        return suspicion(hb, generation, interval, heard=self._control.heard(name, generation))

    def wait_for_peer(
        self, name: str, timeout: float | None = 30.0, regions: Iterable[str] = ()
    ) -> PeerInfo:
        """Block until peer ``name`` is registered (and exposes every region in ``regions``)."""
        check_name("peer name", name)
        want = set(regions)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        directory = self._ep.directory
        while True:
            self._ep.check_open()
            rec = directory.fetch(name)
            if rec is not None and want <= {r.name for r in rec.regions}:
                return peer_info(
                    rec,
                    directory.last_heartbeat(name),
                    self._ep.settings.heartbeat_interval,
                    self._control.heard(name, rec.generation),
                )
            if deadline is not None and time.monotonic() >= deadline:
                missing = (
                    ""
                    if rec is None
                    else f" with regions {sorted(want - {r.name for r in rec.regions})}"
                )
                raise PeerWaitTimeout(
                    f"peer {name!r}{missing} did not appear in namespace {self.namespace!r} within {timeout:.3g} s",
                    name,
                )
            self._ep.stopping.wait(
                min(delay, max(0.0, deadline - time.monotonic())) if deadline else delay
            )
            delay = min(delay * 2, 0.05)

    # -- flight recorder ----------------------------------------------------------------------

    def dump_trace(
        self, directory: str | os.PathLike[str] | None = None, reason: str = "on demand"
    ) -> Path:
        """Write the flight recorder's ring to a new file in ``directory`` (default: the trace
        directory) and return its path; ``transport trace DIR`` reads it."""
        return self._dumps.dump(directory, reason)

    def __repr__(self) -> str:
        return (
            f"<Transport {self.name}#{self.generation} ns={self.namespace} {self._ep.state.value}>"
        )


__all__ = ["Notification", "PeerInfo", "PeerTraffic", "Transport", "__version__"]
