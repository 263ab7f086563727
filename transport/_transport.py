"""The Transport: one process's endpoint. See the class docstring for the rules."""

from __future__ import annotations

import enum
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from time import monotonic_ns
from typing import Any

import numpy as np
import torch

import transport.backends as _backends
from transport._closing import Closing
from transport._withdraw import Withdrawals
from transport.backends.base import READ, WRITE, device_parts
from transport.contract import ControlHandler, CoreLink
from transport.engine import QUEUED, Engine, Op
from transport.errors import (
    BackendError,
    ClosedError,
    PeerLostError,
    PeerNotFoundError,
    PeerWaitTimeout,
    RegionError,
    StoreError,
    TransferTimeout,
    WireFormatError,
)
from transport.handle import Handle
from transport.lanes import Lane, default_lanes
from transport.lanes import split as lanes_split
from transport.memory import LocalMemory, check_tensor, device_of, dtype_name
from transport.peers import Directory
from transport.plan import PeerConn, Plan
from transport.store import DEFAULT_STORE_URL, Store, store_from_url
from transport.trace import DEFAULT_CAPACITY, FlightRecorder
from transport.trace import ENV_DIR as TRACE_ENV_DIR
from transport.wire import (
    ACCESS_MODES,
    TAG_CONTROL,
    PeerRecord,
    RegionInfo,
    agent_name,
    check_name,
    check_region_name,
    frame_control,
    frame_user_notification,
    parse_notification,
    peer_of_agent,
)

log = logging.getLogger("transport")

#: automatic dumps after errors: at most one per this many seconds per Transport
DUMP_MIN_INTERVAL = 5.0
# Lanes cut transfers between host memory only: there the copy runs inside the posting thread
# (CMA), which is what a second agent parallelizes. GPU copies run on the GPU's copy engines; no
# measurement yet shows lanes helping them, so a CUDA transfer stays on one agent.

_sigusr1_lock = threading.Lock()
_sigusr1_transports: weakref.WeakSet[Transport] = weakref.WeakSet()
_sigusr1_previous: Any = None


def _watch_sigusr1(t: Transport) -> None:
    """SIGUSR1 dumps the ring of every Transport of the process that has a trace directory. The
    handler is installed once, from the main thread (elsewhere Python refuses; the Transport then
    dumps on errors and requests only), and calls the handler that was there before."""
    global _sigusr1_previous
    with _sigusr1_lock:
        _sigusr1_transports.add(t)
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
    for t in list(_sigusr1_transports):
        if not t.closed:
            t._request_dump("SIGUSR1")
    prev = _sigusr1_previous
    if callable(prev) and prev not in (signal.SIG_IGN, signal.SIG_DFL):
        prev(signum, frame)


__version__ = "0.1.0"


class _State(enum.Enum):
    """Whether a Transport is open: OPEN from construction, CLOSED from the moment ``close()``
    begins, and never open again.

    Only ``close()`` changes it, under the Transport's lock and once (a second close returns at
    once). Everything else reads it without the lock (``closed``, ``_check_open``, the fast
    paths), so it does not stop a call that checked it just before close began; close fails what
    the engines still hold with ClosedError.
    """

    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class Notification:
    """A notification received from a peer: who sent it and the payload passed as ``notify=``."""

    peer: str
    payload: bytes


@dataclass(frozen=True)
class PeerInfo:
    """A live peer of the namespace, as its record and heartbeat describe it."""

    name: str
    generation: int
    host: str
    pid: int
    version: str
    regions: int
    region_bytes: int
    last_heartbeat: float | None  # wall-clock time, None if it never sent one


def _peer_info(rec: PeerRecord, hb: tuple[int, float] | None) -> PeerInfo:
    return PeerInfo(
        rec.name, rec.generation, rec.host, rec.pid, rec.version, len(rec.regions),
        sum(r.nbytes for r in rec.regions), hb[1] if hb and hb[0] == rec.generation else None,
    )  # fmt: skip


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
      :class:`TransferTimeout` and the transfer is withdrawn. ``wait(timeout)``
      bounds the wait only and cancels nothing.
    * **Peers.** A peer is resolved through the store on first use and cached;
      nothing touches the store on the hot path after that. A peer that dies
      fails its transfers with :class:`PeerLostError`; one that restarts under
      the same name is picked up by the next put or get.
    * **Threads.** All methods are thread-safe. Done-callbacks run on the
      engine thread and must not wait on handles.

    Options: ``timeout`` is the default transfer deadline; transfers of more
    than ``chunk_bytes`` are posted in parts of that size so that one huge post
    does not hold the agent for long (the notification follows the last part);
    transfers of at most ``inline_bytes`` are posted by the calling thread (no
    hand-off); ``idle_interval`` is how often an idle engine makes progress
    (receivers' notified transfers complete at that pace after a quiet spell);
    ``heartbeat_interval`` is how often the store hears from this peer;
    transfers between host memory of at least ``lane_bytes`` are cut over
    ``lanes`` agents, each posting from its own thread (lanes.py; default from
    the CPU count, ``$TRANSPORT_LANES``; 1 turns them off).
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
        idle_interval: float = 5e-3,
        heartbeat_interval: float = 1.0,
        trace_dir: str | os.PathLike[str] | None = None,
        trace_capacity: int = DEFAULT_CAPACITY,
        lanes: int | None = None,
        lane_bytes: int = 64 << 20,
    ) -> None:
        self.name = check_name("peer name", name)
        self.namespace = check_name("namespace", namespace)
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 8):
            raise ValueError(
                "secret must be at least 8 bytes (or a str); every peer of the namespace must share it"
            )
        _positive("timeout", timeout)
        _positive("idle_interval", idle_interval)
        if chunk_bytes < 4096 or inline_bytes < 0:
            raise ValueError("chunk_bytes must be at least 4096 and inline_bytes non-negative")
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_bytes)
        self.inline_bytes = int(inline_bytes)
        self._secret = secret
        self._state = _State.OPEN
        self._lock = threading.RLock()  # guards regions, connections, plans
        self._stream: Any = None  # transport.cuda.stream.StreamOps, on the first stream= call
        # lanes: extra agents for large transfers (lanes.py), started on first use
        self.lanes = default_lanes() if lanes is None else lanes
        if (
            not isinstance(self.lanes, int)
            or isinstance(self.lanes, bool)
            or not 1 <= self.lanes <= 16
        ):
            raise ValueError(
                f"lanes must be an int from 1 to 16 (1: no extra agents), got {lanes!r}"
            )
        if not isinstance(lane_bytes, int) or lane_bytes < 1 << 20:
            raise ValueError(f"lane_bytes must be an int of at least 1 MiB, got {lane_bytes!r}")
        self.lane_bytes = lane_bytes
        self._lanes: list[Lane] = []
        self._backend_kind = backend
        # the flight recorder; automatic dumps (errors, requests of the namespace, SIGUSR1) go to
        # trace_dir, or $TRANSPORT_TRACE_DIR, and nowhere without one
        self.recorder = FlightRecorder(trace_capacity)
        self._rec_append = self.recorder._ring.append if trace_capacity else None
        self._inline_count = 0  # small puts and gets that completed inside their post
        env_dir = os.environ.get(TRACE_ENV_DIR)
        self.trace_dir = Path(trace_dir) if trace_dir else (Path(env_dir) if env_dir else None)
        self._dump_reason: str | None = None
        self._dump_seen = 0
        self._last_dump = 0.0
        self.recorder.on_error = self._on_transfer_error

        if store is None:
            store = os.environ.get("TRANSPORT_STORE", DEFAULT_STORE_URL)
        self._owns_store = not isinstance(store, Store)
        self.store: Store = store_from_url(store) if isinstance(store, str) else store
        if not isinstance(self.store, Store):
            raise TypeError(
                f"store must be a URL or a transport.store.Store, got {type(store).__name__}"
            )
        try:
            self._dir = Directory(self.store, self.namespace, secret)
            self.generation = self._dir.join(self.name)
            self._backend = _backends.new_backend(
                backend, agent_name=agent_name(self.name, self.generation)
            )
        except BaseException:
            if self._owns_store:
                self.store.close()
            raise
        self._mem = LocalMemory(self._backend)
        self._regions: dict[str, tuple[torch.Tensor, RegionInfo]] = {}
        self._local_names: dict[tuple[int, int], str] = {}
        self._conns: dict[str, PeerConn] = {}
        self._plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self.max_plans = 4096
        self._notifs: deque[Notification] = deque()
        self._control_handlers: dict[str, ControlHandler] = {}
        self._withdrawals = Withdrawals(self)
        self._notif_cond = threading.Condition()
        self._created = time.time()
        self._stop_control = threading.Event()
        self._control_wake = threading.Event()
        self._retries: deque[tuple[list[Op], BaseException]] = deque()
        self._engine = Engine(
            self._backend,
            self.name,
            self._on_notifications,
            self._on_peer_lost,
            self._on_retry,
            idle_interval=idle_interval,
        )
        self._engine.start()
        #: the internal contract of the library's own layers (weights/, cuda/): see contract.py
        self.core = CoreLink(
            check_open=self._check_open,
            peer=self._connect_locked,
            on_control=self._on_control,
            send_control=self._send_control,
            put_control=self._put_control,
            put_control_at=self._put_control_at,
            poll_at_least=self._engine.poll_at_least,
            waiting=self._engine.waiting,
            stream_ops=self._stream_ops,
        )
        try:
            self._publish()
            self._dir.heartbeat(self.name, self.generation)
            if self.trace_dir is not None:
                self._dump_seen = self.store.add(self._dump_key, 0)  # answer only newer requests
        except BaseException:
            self.close()
            raise
        if self.trace_dir is not None:
            _watch_sigusr1(self)
        self.heartbeat_interval = heartbeat_interval
        self._control = threading.Thread(
            target=self._control_loop, name=f"transport-control-{name}", daemon=True
        )
        self._control.start()
        log.info(
            "transport %s#%d joined namespace %s on %s",
            self.name,
            self.generation,
            self.namespace,
            self.store,
        )

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def close(self) -> None:
        """Leave the namespace, fail transfers still in flight with ClosedError, release everything.
        Idempotent. Closing the process that hosts the embedded store stops that store."""
        with self._lock:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSED
        self._stop_control.set()
        self._control_wake.set()
        try:
            self._dir.leave(self.name, self.generation)
        except Exception as e:
            log.warning("could not remove %s from the store: %s", self.name, e)
        if self._stream is not None:
            self._stream.close()  # streams waiting on a transfer are released
        for lane in self._lanes:
            lane.engine.stop()
        self._engine.stop()
        if (
            getattr(self, "_control", None) is not None
            and self._control is not threading.current_thread()
        ):
            self._control.join(5.0)
        closed = ClosedError("the Transport was closed before the transfer completed")
        while self._retries:
            for o in self._retries.popleft()[0]:
                o.state = QUEUED
                self._engine.fail(o, closed)
        for conn in list(self._conns.values()):
            conn.close(self._backend)
        self._conns.clear()
        self._plans.clear()
        for lane in self._lanes:
            lane.close()
        self._lanes.clear()
        self._mem.close()
        self._backend.close()
        if self._owns_store:
            self.store.close()
        with self._notif_cond:
            self._notif_cond.notify_all()

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ClosedError(f"transport {self.name!r} is closed; open a new Transport")
        if self._engine.error is not None:
            raise ClosedError(
                f"transport {self.name!r} is unusable: its engine thread died ({self._engine.error!r})"
            )

    # -- exposing and registering memory ------------------------------------------------------------

    def expose(self, name: str, tensor: torch.Tensor, access: str = "rw") -> RegionInfo:
        """Register ``tensor`` and publish it as region ``name`` that peers may write and/or read."""
        return self.expose_all({name: tensor}, access=access)[name]

    def expose_all(
        self, tensors: Mapping[str, torch.Tensor], access: str = "rw"
    ) -> dict[str, RegionInfo]:
        """Expose many tensors with one record update (for example ``model.state_dict()``).
        Everything is checked before anything is exposed."""
        self._check_open()
        if access not in ACCESS_MODES:
            raise ValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"expose_all takes a mapping of name -> tensor, got {type(tensors).__name__}"
            )
        checked = []
        for name, t in tensors.items():
            check_region_name(name)
            check_tensor(t, f"region {name!r}")
            if t.numel() == 0:
                raise ValueError(
                    f"region {name!r} is empty; expose a tensor with at least one element"
                )
            if name in self._regions:
                raise ValueError(
                    f"region {name!r} is already exposed by {self.name!r}; expose it under another name"
                )
            checked.append((name, t))
        out = {}
        with self._lock:
            for _name, t in checked:
                self._mem.ensure(t, explicit=True)
            for name, t in checked:
                info = RegionInfo(
                    name,
                    t.data_ptr(),
                    t.nbytes,
                    dtype_name(t.dtype),
                    tuple(t.shape),
                    access,
                    device_of(t),
                )
                self._regions[name] = (t, info)
                self._local_names[(t.data_ptr(), t.nbytes)] = name
                out[name] = info
            self._publish()
        return out

    def unexpose(self, name: str, timeout: float | None = None) -> list[str]:
        """Withdraw region ``name``: take it out of this peer's record, tell every peer of the
        namespace, wait until each has stopped using it and its transfers into it have ended (at
        most ``timeout`` seconds, default the Transport's), then deregister the memory. Returns
        the peers that did not confirm in time (only they may still write there; none with a
        timeout long enough). Afterwards puts into it fail with RegionError and the tensor is
        the caller's again."""
        if not isinstance(name, str):
            raise TypeError(f"region name must be a str, got {type(name).__name__}")
        if timeout is not None:
            _positive("timeout", timeout)
        return self._withdrawals.withdraw(name, self.timeout if timeout is None else timeout)

    def register(self, tensor: torch.Tensor, name: str | None = None) -> None:
        """Register ``tensor`` as a local source/destination (not visible to peers). With ``name``,
        a put or get of this tensor without ``key`` uses that remote region name."""
        self._check_open()
        check_tensor(tensor)
        if name is not None:
            check_region_name(name)
        with self._lock:
            self._mem.ensure(tensor, explicit=True)
            if name is not None:
                self._local_names[(tensor.data_ptr(), tensor.nbytes)] = name

    def regions(self) -> dict[str, RegionInfo]:
        """The regions this Transport exposes."""
        return {n: info for n, (_, info) in self._regions.items()}

    def _publish(self) -> None:
        rec = PeerRecord(
            name=self.name, namespace=self.namespace, generation=self.generation,
            agent=agent_name(self.name, self.generation), backend=self._backend.name,
            metadata=self._backend.metadata(), host=socket.gethostname()[:255] or "?", pid=os.getpid(),
            version=__version__, created=self._created, regions=tuple(info for _, info in self._regions.values()),
            registrations=self._exposed_registrations(),
        )  # fmt: skip
        self._dir.publish(rec)
        self._record = rec

    def _exposed_registrations(self) -> tuple[tuple[int, int, str], ...]:
        """The registered memory under the exposed regions (each tensor's whole storage, which is
        what the registration cache registers)."""
        seen: dict[tuple[int, str], int] = {}
        for t, info in self._regions.values():
            st = t.untyped_storage()
            key = (st.data_ptr(), info.device)
            seen[key] = max(seen.get(key, 0), st.nbytes())
        return tuple((addr, n, dev) for (addr, dev), n in sorted(seen.items()))

    # -- transfers ----------------------------------------------------------------------------------

    def put(
        self,
        src: torch.Tensor | Mapping[str, torch.Tensor],
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
        region of its name. ``peer`` may be a list of names (fan-out, one handle). ``offset`` is in
        elements of the region. ``notify`` (bytes) reaches the peer after all the data has landed.
        Without ``key`` the name the source was exposed or registered under is used.
        """
        if type(src) is torch.Tensor and stream is None:
            if type(peer) is str:
                if self._stream is not None:
                    self._stream.check()
                handle = self._fast(WRITE, src, peer, key, offset, notify, timeout)
                if handle is not None:
                    return handle
            elif type(peer) in (list, tuple):
                if self._stream is not None:
                    self._stream.check()
                handle = self._fast_fanout(src, peer, key, offset, notify, timeout)  # type: ignore[arg-type]
                if handle is not None:
                    return handle
        return self._transfer(WRITE, src, peer, key, offset, notify, timeout, stream)

    def get(
        self,
        dst: torch.Tensor | Mapping[str, torch.Tensor],
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
        if type(dst) is torch.Tensor and stream is None:
            if self._stream is not None:
                self._stream.check()
            handle = self._fast(READ, dst, peer, key, offset, None, timeout)
            if handle is not None:
                return handle
        return self._transfer(READ, dst, peer, key, offset, None, timeout, stream)

    def _put_control(
        self,
        src: Mapping[str, torch.Tensor],
        peer: str,
        channel: str,
        payload: bytes,
        timeout: float | None,
    ) -> Handle:
        """A batched put whose notification is a control message of ``channel`` (for the library's
        own layers)."""
        return self._transfer(
            WRITE, src, peer, None, 0, None, timeout, None, frame_control(channel, payload)
        )

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
        """A put of one tensor at ``offset`` (elements) of region ``key`` whose notification is a
        control message of ``channel`` (for the library's own layers)."""
        return self._transfer(
            WRITE, src, peer, key, offset, None, timeout, None, frame_control(channel, payload)
        )

    def _fast(
        self,
        op: str,
        t: torch.Tensor,
        peer: str,
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
    ) -> Handle | None:
        """Replay a cached small plan from the caller's thread; None when the general path is needed."""
        ptr, nbytes = t.data_ptr(), t.nbytes
        if key is None:
            key = self._local_names.get((ptr, nbytes))
        plan = self._plans.get((op, peer, (key, ptr, nbytes, t.dtype), offset))
        if (
            plan is None
            or not plan.inline
            or not plan.conn.alive
            or self._state is not _State.OPEN
            or not t.is_contiguous()
            or (timeout is not None and not (type(timeout) in (int, float) and timeout > 0))
        ):
            return None
        notif = frame_user_notification(notify) if notify is not None else b""
        handle = Handle("put" if op == WRITE else "get", (peer,), nbytes, 1)
        handle._rec = self.recorder  # its end is recorded, unless it completes inside the post
        if self._engine.post_fast(
            handle, plan, notif, self.timeout if timeout is None else timeout
        ):
            if handle._state:
                # completed inside its post (it cannot stall): counted, not recorded one by one,
                # so that the ring costs the fastest path nothing it would notice
                self._inline_count += 1
            elif self._rec_append is not None:
                self._rec_append(
                    (monotonic_ns(), "post", handle.id, handle.op, peer, nbytes, key, "")
                )
            return handle
        return None

    def _fast_fanout(
        self,
        t: torch.Tensor,
        peers: list[str] | tuple[str, ...],
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
    ) -> Handle | None:
        """A small put to several peers, each a cached one-part plan, posted one after the other
        from the caller's thread (as a single-peer put is); None when the general path is needed.
        A peer whose post fails (it was lost or restarted meanwhile) and the peers after it go
        through the general path, as part of the same handle."""
        n = len(peers)
        if n < 2 or n > 64 or self._state is not _State.OPEN or not t.is_contiguous():
            return None
        if timeout is not None and not (type(timeout) in (int, float) and timeout > 0):
            return None
        ptr, nbytes = t.data_ptr(), t.nbytes
        if key is None:
            key = self._local_names.get((ptr, nbytes))
        sig = (key, ptr, nbytes, t.dtype)
        plans = []
        for peer in peers:
            plan = self._plans.get((WRITE, peer, sig, offset)) if type(peer) is str else None
            if plan is None or not plan.inline or not plan.conn.alive:
                return None
            plans.append(plan)
        if len(set(peers)) != n:
            return None  # the general path says why
        notif = frame_user_notification(notify) if notify is not None else b""
        handle = Handle("put", tuple(peers), nbytes * n, n + 1)  # + 1: held until all is posted
        timeout = self.timeout if timeout is None else timeout
        inflight: list[Op] = []
        done_now: list[str] = []
        for i, plan in enumerate(plans):
            r = self._engine.post_inline(handle, plan, notif, timeout)
            if r is True:
                done_now.append(peers[i])
            elif r is not None:
                inflight.append(r)
            elif i == 0:
                return None  # nothing sent yet: the general path does it all
            else:
                self._rest_of_fanout(handle, t, tuple(peers[i:]), key, offset, notify, timeout)
                break
        if len(done_now) == n:
            # every part completed inside its post and nothing else saw the handle: counted, not
            # recorded (like a single-peer put on this path)
            handle._complete_now()
            self._inline_count += n
            return handle
        handle._rec = self.recorder
        self.recorder.record("post", handle.id, handle.op, handle.peers, handle.nbytes, key)
        if inflight:
            handle._poller = self._engine.poller(inflight)
        for peer in done_now:
            handle._part_done(peer, None)
        handle._part_done(peers[0], None)  # the hold
        return handle

    def _rest_of_fanout(
        self,
        handle: Handle,
        t: torch.Tensor,
        rest: tuple[str, ...],
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float,
    ) -> None:
        """The peers of a fast fan-out from the first whose post failed on: through the general
        path (which re-plans a restarted peer), their parts completing ``handle``'s."""
        try:
            sub = self._transfer(WRITE, t, list(rest), key, offset, notify, timeout, None)
        except Exception as e:  # noqa: BLE001 - reported as those peers' error, through the handle
            for p in rest:
                handle._part_done(p, e)
            return

        def done(h: Handle) -> None:
            for p in rest:
                # each failed peer is in errors; a failure that names none is every peer's
                handle._part_done(p, h.errors.get(p) or (None if h.errors else h._error))

        sub.add_done_callback(done)

    def _transfer(
        self,
        op: str,
        obj: Any,
        peer: str | Iterable[str],
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
        stream: Any,
        frame: bytes | None = None,
        proxy: bool = False,
    ) -> Handle:
        if self._state is not _State.OPEN:
            self._check_open()
        if self._stream is not None and not proxy:
            self._stream.check()  # an error of a stream-ordered transfer surfaces here
        if stream is not None:
            return self._stream_op(op, obj, peer, key, offset, notify, timeout, stream)
        peers = (peer,) if isinstance(peer, str) else _peer_list(peer)
        items, sig = self._items(obj, key, offset)
        if timeout is None:
            timeout = self.timeout
        else:
            _positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        notif = (
            frame
            if frame is not None
            else (frame_user_notification(notify) if notify is not None else b"")
        )
        plans = [self._plan(op, p, items, sig, offset) for p in peers]
        handle = Handle("put" if op == WRITE else "get", peers, sum(p.nbytes for p in plans), 0)
        handle._rec = self.recorder
        # names only (the signature holds no tensor): the ring must not keep memory alive
        self.recorder.record(
            "post",
            handle.id,
            handle.op,
            peers,
            handle.nbytes,
            items[0][0] if len(items) == 1 else sig,
        )
        ops: list[Op] = []
        inline = True
        for plan in plans:
            if self.lanes > 1 and plan.nbytes >= self.lane_bytes and plan.rows.host_only:
                args = (items, sig, offset, notif, deadline, timeout)
                try:
                    ops.extend(self._lane_ops(handle, plan, *args))
                except PeerLostError:
                    if plan.conn.alive:
                        raise
                    # its connection was dropped while the plan was cut (a newer incarnation)
                    plan = self._plan(op, plan.conn.name, items, sig, offset)
                    ops.extend(self._lane_ops(handle, plan, *args))
                inline = False
                continue
            parts = plan.parts
            if len(parts) == 1:
                ops.append(Op(handle, plan, parts[0], notif, deadline, timeout))
                inline = inline and plan.nbytes <= self.inline_bytes
                continue
            inline = False
            group = [Op(handle, plan, part, b"", deadline, timeout) for part in parts[:-1]]
            last = Op(handle, plan, parts[-1], notif, deadline, timeout)
            if notif:
                last.after = list(group)  # the notification goes after every other part has landed
            group.append(last)
            for o in group:
                o.group = group
            group[0].retry = (items, sig, offset)
            ops.extend(group)
        if not inline:
            for o in ops:
                if o.group is None:
                    o.group = [o]
                    o.retry = (items, sig, offset)
        handle._remaining = len(ops)
        if inline:
            handle._poller = self._engine.poller(ops)
            for i, o in enumerate(ops):
                try:
                    self._engine.post_now(o, lost_raises=True)
                except PeerLostError as e:
                    retry = self._after_loss(o, items, sig, offset)
                    if retry is None:
                        self._engine.fail(o, e)
                    else:
                        ops[i] = retry  # the poller sees the list, so it polls the retry
                        self._engine.post_now(retry)
        elif not self._lanes:
            self._engine.submit(ops)
        else:
            by_engine: dict[int, tuple[Engine, list[Op]]] = {}
            for o in ops:
                eng = o.engine or self._engine
                by_engine.setdefault(id(eng), (eng, []))[1].append(o)
            for eng, group_ops in by_engine.values():
                eng.submit(group_ops)
        return handle

    def _lane_ops(
        self,
        handle: Handle,
        plan: Plan,
        items: tuple[tuple[str, torch.Tensor], ...],
        sig: tuple[Any, ...],
        offset: int,
        notif: bytes,
        deadline: float,
        timeout: float,
    ) -> list[Op]:
        """The ops of one large transfer cut over the lanes: one group; the notification on the
        last part of share 0, after every other part of every share has landed."""
        with self._lock:
            if not self._lanes:
                self._start_lanes()
            shares = lanes_split(plan, self._lanes, self._backend, [t for _, t in items])
        group: list[Op] = []
        for share, lane in shares:
            eng = lane.engine if lane is not None else self._engine
            for part in share.parts:
                o = Op(handle, share, part, b"", deadline, timeout)
                o.engine = eng
                group.append(o)
        last = group[len(shares[0][0].parts) - 1]
        if notif:
            last.notif = notif
            last.after = [o for o in group if o is not last]
        # The first part goes alone: if it finds the peer restarted, nothing else was posted and
        # the whole transfer is re-planned on the new incarnation (as an unsplit one would be).
        first = group[0]
        assert first is not last or len(group) == 1
        first.retry = (items, sig, offset)
        for o in group[1:]:
            if o.after is None:
                # share 0's parts too: posted behind the first, they would keep its engine from
                # seeing it complete (and the lanes from starting) for a whole part's copy
                o.after = [first]
        first.wakes = [lane.engine for _, lane in shares if lane is not None]
        for o in group:
            o.group = group
        if self._rec_append is not None:
            self.recorder.record("lanes", handle.id, handle.op, plan.conn.name, plan.nbytes,
                                 None, f"{len(shares)} shares")  # fmt: skip
        return group

    def _start_lanes(self) -> None:
        """With the lock held: the extra agents, each with its own posting thread."""
        base = agent_name(self.name, self.generation)
        for i in range(1, self.lanes):
            backend = _backends.new_backend(self._backend_kind, agent_name=f"{base}.lane{i}")
            lane = Lane(backend, f"{self.name}-lane{i}", self._engine.idle_interval)
            lane.engine.on_finish = self._engine.wake
            self._lanes.append(lane)

    def _items(
        self, obj: Any, key: str | None, offset: int
    ) -> tuple[tuple[tuple[str, torch.Tensor], ...], tuple[Any, ...]]:
        """The (region name, tensor) pairs of a put or get, and the signature of its plan."""
        if type(offset) is not int or offset < 0:
            raise ValueError(
                f"offset must be a non-negative int (elements of the region), got {offset!r}"
            )
        if isinstance(obj, torch.Tensor):
            if not obj.is_contiguous() or obj.layout != torch.strided:
                check_tensor(obj)
            if key is None:
                key = self._local_names.get((obj.data_ptr(), obj.nbytes))
                if key is None:
                    raise ValueError(
                        "no key given and the tensor was never exposed or registered under a name; "
                        "pass key='region' or call register(tensor, name='region')"
                    )
            items: tuple[tuple[str, torch.Tensor], ...] = ((key, obj),)
            sig: tuple[Any, ...] = (key, obj.data_ptr(), obj.nbytes, obj.dtype)
        elif isinstance(obj, Mapping):
            if key is not None:
                raise ValueError(
                    "key= cannot be combined with a dict; the dict's keys name the regions"
                )
            if offset:
                raise ValueError(
                    "offset= cannot be combined with a dict; put each tensor separately"
                )
            if not obj:
                raise ValueError("the dict of tensors is empty")
            items = tuple(obj.items())
            # The signature is all a cached plan needs; full checks run when a plan is built. A
            # tensor matching a cached plan's (pointer, size, dtype) is that same memory, so only
            # its layout can have changed.
            try:
                sig = tuple([(k, t.data_ptr(), t.nbytes, t.dtype) for k, t in items])
                contiguous = all([t.is_contiguous() for _, t in items])
            except (AttributeError, TypeError, RuntimeError):
                contiguous = False
            if not contiguous:
                for k, t in items:
                    check_tensor(t, f"tensor {k!r}")
        else:
            raise TypeError(
                f"expected a torch.Tensor or a dict of name -> torch.Tensor, got {type(obj).__name__}"
            )
        return items, sig

    def _stream_op(
        self,
        op: str,
        obj: Any,
        peer: str | Iterable[str],
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
        stream: Any,
    ) -> Any:
        """Enqueue the transfer on ``stream``: checked and planned now, posted by the proxy
        thread when the stream reaches it (see transport.cuda)."""
        ops = self._stream_ops()
        peers = (peer,) if isinstance(peer, str) else _peer_list(peer)
        items, sig = self._items(obj, key, offset)
        for p in peers:
            self._plan(op, p, items, sig, offset)  # every check before anything is enqueued
        if timeout is not None:
            _positive("timeout", timeout)

        def start() -> Handle:
            return self._transfer(op, obj, peer, key, offset, notify, timeout, None, proxy=True)

        what = f"{'put' if op == WRITE else 'get'} to {', '.join(peers)}"
        return ops.enqueue((op, peers, sig, offset, notify), start, what, stream)

    def _stream_ops(self) -> Any:
        """The stream machinery, created on first use; a clear error without CUDA or CuPy."""
        if self._stream is None:
            from transport.cuda import stream as cuda_stream

            why = cuda_stream.unavailable()
            if why is not None:
                raise RuntimeError(why)
            with self._lock:
                if self._stream is None:
                    self._stream = cuda_stream.StreamOps()
        return self._stream

    def check(self) -> None:
        """Raise the oldest error of a stream-ordered transfer not raised yet (they surface at the
        next put or get, or a handle's wait, too). Nothing to do without stream= transfers."""
        self._check_open()
        if self._stream is not None:
            self._stream.check()

    def _after_loss(
        self,
        lost: Op,
        items: tuple[tuple[str, torch.Tensor], ...],
        sig: tuple[Any, ...],
        offset: int,
    ) -> Op | None:
        """A post to a peer failed because it is gone. If it has restarted under the same name, return
        an op for the new incarnation (nothing was sent to the old one), else None."""
        old = lost.plan.conn
        self._on_peer_lost(old, PeerLostError("lost while posting", old.name))
        try:
            rec = self._dir.fetch(old.name)
        except (StoreError, WireFormatError):
            return None
        if rec is None or rec.generation <= old.generation:
            return None
        plan = self._plan(lost.plan.op, old.name, items, sig, offset)
        if len(plan.parts) != 1:
            return None
        log.info("peer %s restarted (generation %d); retrying on it", old.name, rec.generation)
        return Op(lost.handle, plan, plan.parts[0], lost.notif, lost.deadline, lost.timeout)

    def _plan(
        self,
        op: str,
        peer: str,
        items: tuple[tuple[str, torch.Tensor], ...],
        sig: tuple[Any, ...],
        offset: int,
    ) -> Plan:
        ckey = (op, peer, sig, offset)
        plan = self._plans.get(ckey)
        if plan is not None and plan.valid and plan.conn.alive:
            return plan
        with self._lock:
            self._check_open()
            conn = self._connect(peer)
            try:
                plan = self._build_plan(op, conn, items, offset)
            except RegionError:
                # the peer may have exposed more since we read its record
                fresh = self._connect(peer, refresh=True)
                plan = self._build_plan(op, fresh, items, offset)
            except PeerLostError:
                if conn.alive:
                    raise
                # the connection was dropped while the plan was made (the control thread saw a
                # newer incarnation, or a transfer saw the peer go): plan on what the store holds
                fresh = self._connect(peer, refresh=True)
                plan = self._build_plan(op, fresh, items, offset)
            plan.inline = len(plan.parts) == 1 and plan.nbytes <= self.inline_bytes
            self._plans[ckey] = plan
            plan.conn.plans.add(plan)
            if self._mem.over_limit():
                self._shed_plans(plan)
            for _ in range(len(self._plans) - self.max_plans):
                old_key, old = next(iter(self._plans.items()))
                if not self._forget_plan(old_key, old):  # in flight: keep it, retry later
                    self._plans.move_to_end(old_key)
        return plan

    def _forget_plan(self, key: tuple[Any, ...], plan: Plan) -> bool:
        """With the lock held: drop a cached plan and release it, unless transfers are in flight
        on it (False then)."""
        with plan.conn.lock:
            if plan.in_flight:
                return False
            del self._plans[key]
            plan.conn.plans.discard(plan)
            plan.release(self._backend)
        return True

    def _shed_plans(self, current: Plan) -> None:
        """With the lock held: implicit registrations are over their limits, and plans pin them.
        Release the least recently made idle plans on implicit memory (a later put of the same
        tensors plans again) until registrations can be dropped."""
        for key, old in list(self._plans.items()):
            if not self._mem.over_limit():
                break
            if old is current or not any(not r.explicit for r in old.keep):
                continue
            if self._forget_plan(key, old):
                self._mem.evict()

    def _build_plan(
        self, op: str, conn: PeerConn, items: tuple[tuple[str, torch.Tensor], ...], offset: int
    ) -> Plan:
        n = len(items)
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        keep = []
        devices, rdevices = set(), set()
        rows = 0
        for key, t in items:
            if not isinstance(key, str):
                raise TypeError(f"dict keys must be region names (str), got {type(key).__name__}")
            check_tensor(t, f"tensor {key!r}")
            region = conn.regions.get(key)
            if region is None:
                raise RegionError(_missing_region(conn, key))
            if op == WRITE and not region.writable:
                raise RegionError(
                    f"peer {conn.name!r} exposes region {key!r} read-only (access={region.access!r}); "
                    "it cannot be written; ask the peer to expose it with access='w' or 'rw'"
                )
            if op == READ and not region.readable:
                raise RegionError(
                    f"peer {conn.name!r} exposes region {key!r} write-only (access={region.access!r}); "
                    "it cannot be read; ask the peer to expose it with access='r' or 'rw'"
                )
            dt = dtype_name(t.dtype)
            if dt != region.dtype:
                raise RegionError(
                    f"dtype mismatch for region {key!r} of peer {conn.name!r}: the tensor is {dt}, the region "
                    f"is {region.dtype}; convert with .to(torch.{region.dtype}) or view the bytes with .view()"
                )
            start = offset * region.itemsize
            if start + t.nbytes > region.nbytes:
                raise RegionError(
                    f"{t.numel()} elements at offset {offset} do not fit region {key!r} of peer {conn.name!r} "
                    f"({region.numel} elements of {region.dtype}, shape {list(region.shape)}); "
                    "send a smaller slice or a smaller offset"
                )
            if t.nbytes == 0:
                continue
            keep.append(self._mem.ensure(t))
            dev = device_of(t)
            devices.add(device_parts(dev)[0])
            rdevices.add(device_parts(region.device)[0])
            local[rows] = (t.data_ptr(), t.nbytes, device_parts(dev)[1])
            remote[rows] = (region.addr + start, t.nbytes, device_parts(region.device)[1])
            rows += 1
        if rows == 0:
            raise ValueError("every tensor is empty; there is nothing to transfer")
        if len(devices) > 1 or len(rdevices) > 1:
            raise ValueError(
                "one transfer cannot mix CPU and CUDA memory; split the batch by device"
            )
        device = "cpu" if "DRAM" in devices else "cuda:0"
        rdevice = "cpu" if "DRAM" in rdevices else "cuda:0"
        plan = Plan(
            self._backend,
            conn,
            op,
            local[:rows],
            remote[:rows],
            device,
            rdevice,
            self.chunk_bytes,
            tuple(keep),
        )
        for reg in keep:
            reg.users += 1
        plan.regions = frozenset(key for key, _ in items)
        return plan

    def _connect(self, peer: str, refresh: bool = False) -> PeerConn:
        conn = self._conns.get(peer)
        if conn is not None and conn.alive and not refresh:
            return conn
        rec = self._dir.fetch(peer)
        if rec is None:
            if conn is not None:
                self._drop_conn(conn)
            raise PeerNotFoundError(self._not_found_message(peer), peer)
        if rec.backend != self._backend.name:
            raise WireFormatError(
                f"peer {peer!r} uses backend {rec.backend!r}; this Transport uses {self._backend.name!r}"
            )
        if conn is not None and conn.alive and rec.generation == conn.generation:
            if rec != conn.record:
                self._backend.add_peer(rec.metadata)  # same agent, more registered memory
                conn.record, conn.regions = rec, rec.region_map()
            return conn
        if conn is not None:
            self._drop_conn(conn)  # the old incarnation, and every plan made for it
        try:
            loaded = self._backend.add_peer(rec.metadata)
        except BackendError as e:
            raise PeerLostError(
                f"peer {peer!r} (generation {rec.generation}) is registered but cannot be reached; it may have "
                "died without leaving (its record stays until it restarts) [" + str(e) + "]",
                peer,
            ) from e
        if loaded != rec.agent:
            self._backend.remove_peer(loaded)
            raise WireFormatError(
                f"peer {peer!r}'s record names agent {rec.agent!r} but its metadata is of {loaded!r}"
            )
        conn = PeerConn(rec, loaded)
        self._conns[peer] = conn
        self.recorder.record("join", peers=peer, info=f"generation {rec.generation}")
        return conn

    def _connect_locked(self, peer: str, refresh: bool = False) -> PeerConn:
        """_connect() under the lock, for the library's own layers (``core.peer``)."""
        with self._lock:
            self._check_open()
            return self._connect(peer, refresh)

    def _drop_conn(self, conn: PeerConn) -> None:
        self.recorder.record("leave", peers=conn.name, info=f"generation {conn.generation}")
        conn.close(self._backend)
        with self._lock:
            for k in [k for k, p in self._plans.items() if p.conn is conn]:
                del self._plans[k]
            if self._conns.get(conn.name) is conn:
                del self._conns[conn.name]

    def _not_found_message(self, peer: str) -> str:
        try:
            known = [
                n
                for n in self._dir.names()
                if n != self.name and self._dir.store.try_get(self._dir.key("peers", n))
            ]
        except StoreError:
            known = []
        hint = (
            f"known peers: {', '.join(known[:8])}" + (" ..." if len(known) > 8 else "")
            if known
            else "no other peers are registered"
        )
        return (
            f"no peer named {peer!r} in namespace {self.namespace!r} ({hint}); "
            "check the name and namespace, or wait_for_peer() before the first put"
        )

    # -- engine callbacks (engine thread) -------------------------------------------------------

    def _on_peer_lost(self, conn: PeerConn, error: BaseException) -> None:
        # Runs on the engine thread: only the connection's own lock, never the Transport's (a user
        # thread may hold that while it talks to the store). Stale plans are purged by _connect.
        if conn.alive:
            log.warning("peer %s#%d lost: %s", conn.name, conn.generation, error)
            self.recorder.record("lost", peers=conn.name, info=str(error)[:300])
            conn.close(self._backend)

    def _on_notifications(self, notifs: dict[str, list[bytes]]) -> None:
        out = []
        for agent, frames in notifs.items():
            who = peer_of_agent(agent)
            if who is None:
                log.warning(
                    "dropping %d notifications from unknown agent %r", len(frames), agent[:80]
                )
                continue
            for frame in frames:
                try:
                    tag, channel, payload = parse_notification(frame)
                except WireFormatError as e:
                    log.warning("dropping a notification from %s: %s", who[0], e)
                    continue
                self.recorder.record("notif", 0, channel or "", who[0], len(payload))
                if tag == TAG_CONTROL:
                    handler = self._control_handlers.get(channel)
                    if handler is None:
                        log.debug(
                            "dropping a %r control message from %s: no handler", channel, who[0]
                        )
                        continue
                    try:
                        handler(who[0], payload)
                    except Exception:  # a layer's handler must not kill the engine
                        log.exception(
                            "the %r control handler failed on a message from %s", channel, who[0]
                        )
                    continue
                out.append(Notification(who[0], payload))
        if out:
            with self._notif_cond:
                self._notifs.extend(out)
                self._notif_cond.notify_all()

    # -- notifications ------------------------------------------------------------------------------

    def notify(self, peer: str, payload: bytes) -> None:
        """Send a notification without data to ``peer``; it arrives after every transfer this
        Transport completed to that peer before the call."""
        self._send_frame(peer, frame_user_notification(payload))

    def _send_control(self, peer: str, channel: str, payload: bytes) -> None:
        """Send a library-internal message (see ``_on_control``)."""
        self._send_frame(peer, frame_control(channel, payload))

    def _on_control(self, channel: str, handler: ControlHandler) -> Callable[[], None]:
        """Route control messages of ``channel`` to ``handler(peer, payload)`` (on the engine
        thread); returns the call that stops it. One handler per channel."""
        with self._lock:
            if channel in self._control_handlers:
                raise ValueError(
                    f"control channel {channel!r} already has a handler on this Transport (a "
                    "second weight publisher or subscriber of one group?); close the first"
                )
            self._control_handlers[channel] = handler

        def stop() -> None:
            with self._lock:
                if self._control_handlers.get(channel) is handler:
                    del self._control_handlers[channel]

        return stop

    def _send_frame(self, peer: str, frame: bytes) -> None:
        self._check_open()
        check_name("peer name", peer)
        conn = self._conns.get(peer)
        if conn is None or not conn.alive:
            conn = self._connect_locked(peer)
        with conn.lock:
            if not conn.alive:
                raise PeerLostError(
                    f"peer {peer!r} was lost; the next call reconnects if it has restarted", peer
                )
            try:
                self._backend.send_notif(conn.agent, frame, peer)
            except PeerLostError:
                lost = True
            else:
                lost = False
        if lost:
            conn.close(self._backend)
            raise PeerLostError(f"peer {peer!r} was lost while notifying it", peer)

    def notifications(self, timeout: float | None = None) -> Iterator[Notification]:
        """Yield notifications as they arrive until ``timeout`` seconds have passed (``0``: only
        those already here; ``None``: until the Transport closes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._notif_cond:
                if not self._notifs and not self._await_notification(deadline):
                    return
                n = self._notifs.popleft()
            yield n

    def wait_notification(
        self, timeout: float | None = None, peer: str | None = None
    ) -> Notification:
        """The next notification (from ``peer`` if given; others stay queued). TransferTimeout at the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._notif_cond:
            while True:
                for i, n in enumerate(self._notifs):
                    if peer is None or n.peer == peer:
                        del self._notifs[i]
                        return n
                self._check_open()
                if not self._await_notification(deadline, after=len(self._notifs)):
                    who = f" from {peer!r}" if peer else ""
                    raise TransferTimeout(f"no notification{who} arrived within {timeout:.3g} s")

    def _await_notification(self, deadline: float | None, after: int = 0) -> bool:
        """With ``_notif_cond`` held: wait until more than ``after`` notifications are queued.
        False at the deadline or when the Transport closes."""
        self._engine.waiting(+1)
        try:
            while len(self._notifs) <= after:
                if self._state is not _State.OPEN:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._notif_cond.wait(0.1 if left is None else min(left, 0.1))
            return True
        finally:
            self._engine.waiting(-1)

    # -- peers --------------------------------------------------------------------------------------

    def peers(self) -> list[PeerInfo]:
        """The live peers of the namespace (those with a record), this one included."""
        out = []
        for name in self._dir.names():
            try:
                rec = self._dir.fetch(name)
            except WireFormatError as e:
                log.warning("skipping peer %s: %s", name, e)
                continue
            if rec is not None:
                out.append(_peer_info(rec, self._dir.last_heartbeat(name)))
        return out

    def wait_for_peer(
        self, name: str, timeout: float | None = 30.0, regions: Iterable[str] = ()
    ) -> PeerInfo:
        """Block until peer ``name`` is registered (and exposes every region in ``regions``)."""
        check_name("peer name", name)
        want = set(regions)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            self._check_open()
            rec = self._dir.fetch(name)
            if rec is not None and want <= {r.name for r in rec.regions}:
                return _peer_info(rec, self._dir.last_heartbeat(name))
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
            self._stop_control.wait(
                min(delay, max(0.0, deadline - time.monotonic())) if deadline else delay
            )
            delay = min(delay * 2, 0.05)

    def _on_retry(self, group: list[Op], error: BaseException) -> None:
        """Engine thread: a transfer's first post found its peer gone. The control thread re-plans it."""
        self._retries.append((group, error))
        self._control_wake.set()

    def _run_retries(self) -> None:
        while self._retries:
            group, error = self._retries.popleft()
            first = group[0]
            old = first.plan.conn
            self._on_peer_lost(old, error)
            new_ops: list[Op] = []
            try:
                rec = self._dir.fetch(old.name)
                if (
                    rec is not None
                    and rec.generation > old.generation
                    and self._state is _State.OPEN
                ):
                    items, sig, offset = first.retry
                    plan = self._plan(first.plan.op, old.name, items, sig, offset)
                    notif = next((o.notif for o in group if o.notif), b"")
                    new_ops = [
                        Op(first.handle, plan, part, b"", first.deadline, first.timeout)
                        for part in plan.parts
                    ]
                    new_ops[-1].notif = notif
                    if notif and len(new_ops) > 1:
                        new_ops[-1].after = new_ops[:-1]
                    for o in new_ops:
                        o.group = new_ops
                    log.info(
                        "peer %s restarted (generation %d); retrying on it",
                        old.name,
                        rec.generation,
                    )
            except Exception as e:  # the store or the new peer failed us: report the loss
                log.warning("could not retry a transfer to %s: %s", old.name, e)
                new_ops = []
            if new_ops:
                first.handle._resize(len(new_ops) - len(group))
                self._engine.submit(new_ops)
            else:
                for o in group:
                    o.state = QUEUED
                    self._engine.fail(o, error)

    def _control_loop(self) -> None:
        """Heartbeats, retries of transfers to restarted peers, and noticing connected peers that
        restarted under the same name."""
        next_beat = time.monotonic() + self.heartbeat_interval
        while not self._stop_control.is_set():
            self._control_wake.wait(max(0.0, next_beat - time.monotonic()))
            self._control_wake.clear()
            if self._stop_control.is_set():
                break
            if self._retries:
                self._run_retries()
            if self._dump_reason is not None:
                self._dump_now()
            self._withdrawals.run()
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.heartbeat_interval
            try:
                if self.trace_dir is not None:
                    requested = self.store.add(self._dump_key, 0)
                    if requested > self._dump_seen:
                        self._dump_seen = requested
                        self._dump_to_dir("a peer of the namespace asked (it saw an error)")
                self._dir.heartbeat(self.name, self.generation)
                if self._dir.restore(self._record):
                    log.warning(
                        "transport %s: the store had lost its record (restarted?); published it again",
                        self.name,
                    )
                    self.recorder.record(
                        "join", peers=self.name, info="record restored in the store"
                    )
                for conn in list(self._conns.values()):
                    if conn.alive and self._dir.generation(conn.name) > conn.generation:
                        log.info(
                            "peer %s restarted; dropping generation %d", conn.name, conn.generation
                        )
                        self._drop_conn(conn)
            except Exception as e:  # the store may be down; transfers go on without it
                log.warning("transport %s: store unavailable for heartbeats: %s", self.name, e)

    # -- flight recorder -------------------------------------------------------------------------

    def dump_trace(
        self, directory: str | os.PathLike[str] | None = None, reason: str = "on demand"
    ) -> Path:
        """Write the flight recorder's ring to a new file in ``directory`` (default: the trace
        directory) and return its path; ``transport trace DIR`` reads it."""
        d = directory if directory is not None else self.trace_dir
        if d is None:
            raise ValueError(
                f"no directory: pass one, or give Transport(trace_dir=...) or ${TRACE_ENV_DIR}"
            )
        return self.recorder.dump(d, self._trace_header(reason))

    def _trace_header(self, reason: str) -> dict[str, Any]:
        return {"name": self.name, "generation": self.generation, "namespace": self.namespace,
                "reason": reason, "inline_completed": self._inline_count}  # fmt: skip

    @property
    def _dump_key(self) -> str:
        return f"transport/{self.namespace}/trace/requests"

    def _on_transfer_error(self, kind: str) -> None:
        """A transfer failed (any thread, often the engine's): dump, and ask the namespace to."""
        if self.trace_dir is not None and self._dump_reason is None:
            self._dump_reason = f"a transfer ended with a {kind}"
            self._control_wake.set()

    def _request_dump(self, reason: str) -> None:
        """From a signal handler: only a flag and a wake-up."""
        self._dump_reason = reason
        self._control_wake.set()

    def _dump_now(self) -> None:
        reason, self._dump_reason = self._dump_reason or "", None
        if reason.startswith("a transfer"):
            if time.monotonic() - self._last_dump < DUMP_MIN_INTERVAL:
                return  # one error storm, one round of dumps
            try:
                self._dump_seen = self.store.add(self._dump_key, 1)
            except Exception as e:
                log.warning("transport %s: could not ask the namespace to dump: %s", self.name, e)
        self._dump_to_dir(reason)

    def _dump_to_dir(self, reason: str) -> None:
        if self.trace_dir is None:
            return
        self._last_dump = time.monotonic()
        try:
            path = self.recorder.dump(self.trace_dir, self._trace_header(reason))
        except OSError as e:
            log.warning("transport %s: could not write its trace: %s", self.name, e)
            return
        log.info("transport %s: trace written to %s (%s)", self.name, path, reason)

    def __repr__(self) -> str:
        return f"<Transport {self.name}#{self.generation} ns={self.namespace} {self._state.value}>"


def _positive(what: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")


def _peer_list(peer: Iterable[str]) -> tuple[str, ...]:
    try:
        peers = tuple(peer)
    except TypeError:
        raise TypeError(
            f"peer must be a name or a list of names, got {type(peer).__name__}"
        ) from None
    if not peers:
        raise ValueError("the list of peers is empty")
    for p in peers:
        if not isinstance(p, str):
            raise TypeError(f"peer names must be str, got {type(p).__name__}")
    if len(set(peers)) != len(peers):
        raise ValueError("a peer appears twice in the list; each peer gets one copy")
    return peers


def _missing_region(conn: PeerConn, key: str) -> str:
    names = list(conn.regions)
    if not names:
        return f"peer {conn.name!r} has no region {key!r}; it exposes no regions yet"
    return (
        f"peer {conn.name!r} has no region {key!r}; it exposes {len(names)} regions, e.g. {names[0]!r}"
        + (f", {names[1]!r}" if len(names) > 1 else "")
    )


__all__ = ["Notification", "PeerInfo", "Transport"]
