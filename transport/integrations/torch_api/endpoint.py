"""The ``transport`` backend of torch's transport API: one endpoint, one peer, our engine."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch
from torch.distributed._transport import Transport as TorchApi

from transport import Handle, PeerNotFoundError, RegionError
from transport.integrations.torch_api import engines
from transport.integrations.torch_api.descriptors import EndpointUrl, RemoteRegion
from transport.integrations.torch_api.memory import (
    MemoryView,
    MutableMemoryView,
    Registration,
    TransportMemory,
)
from transport.integrations.torch_api.work import TransferWork, check_timeout

_OPEN, _CLOSING, _CLOSED = "open", "closing", "closed"


class TorchTransport(TorchApi):
    """torch's ``Transport`` on this library's engine: ``new_transport("transport", ...)``.

    It owns one endpoint: its peer (set once by :meth:`connect`), its registrations (each a
    region of the engine, see memory.py) and its transfers in flight. The engine (agent, lanes,
    engine thread) is shared by every endpoint of the process made with the same options
    (engines.py); ``shared=False`` gives the endpoint one of its own.

    Rules, as torch's API documents them, and what is more here:

    * ``bind()`` returns the engine's peer record (sealed with ``secret``); ``connect()`` takes
      the peer's, checks it (a URL sealed with another secret, or none when one is set, raises
      ``SignatureError``) and connects the engine to that peer. Two endpoints of one process
      (of one engine) copy between each other directly.
    * Every write and read has a deadline (``timeout``, default the endpoint's): a peer that
      does not complete it in time (frozen, partitioned) fails it with ``TransferTimeout``, a
      builtin ``TimeoutError``, and the transfer is withdrawn: its buffers are the caller's
      again. A peer that dies fails it with ``PeerLostError``. ``Work.wait(timeout)`` and the
      asyncio calls' timeouts bound the wait only.
    * Writes land at the start of the remote registration (torch's descriptors have no
      offset); a local view may be any byte range of its registration.
    * ``write_stream``/``read_stream`` order the transfer on a CUDA stream with the library's
      stream machinery: a failed transfer is raised by the next call of this endpoint on that
      engine, not by ending the process.
    * ``close()`` waits for the endpoint's transfers (at most ``timeout``: past it,
      ``TimeoutError``, nothing released, and close may be retried), withdraws its
      registrations and releases the engine. Idempotent.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        namespace: str = "torch",
        secret: bytes | str | None = None,
        timeout: float = 30.0,
        shared: bool = True,
        lanes: int | None = None,
        lane_bytes: int | None = None,
        max_registered_bytes: int | None = None,
    ) -> None:
        super().__init__(device)
        if self.device is not None and self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the transport backend moves CPU or CUDA memory, not {self.device}")
        check_timeout(timeout)
        if timeout == 0:
            raise ValueError(
                "the default timeout must be positive: it is every transfer's deadline"
            )
        if isinstance(secret, str):
            secret = secret.encode()
        options = engines.EngineOptions(namespace, secret, lanes, lane_bytes, max_registered_bytes)
        self._engine = engines.acquire(options, private=not shared)
        self._default_timeout: float | None = float(timeout)
        self._timeout = float(timeout)
        self._lock = threading.RLock()
        self._state = _OPEN
        self._peer: str | None = None
        self._local_peer = False  # the peer is an endpoint of our own engine
        self._registrations: dict[tuple[int, int, str], Registration] = {}
        self._mine: set[int] = set()  # id() of each registration above
        self._in_flight: dict[int, tuple[Handle, Registration]] = {}

    # -- the endpoint --------------------------------------------------------------------------

    @staticmethod
    def supported() -> bool:
        """Whether NIXL is installed here (this backend's agents are NIXL's). Never raises."""
        try:
            from transport.backends import nixl

            return nixl.installed()
        except Exception:
            return False

    @property
    def engine_name(self) -> str:
        """The name of the engine (its peer name) this endpoint uses."""
        return self._engine.name

    @property
    def engine(self) -> Any:
        """The ``transport.Transport`` under this endpoint (shared with the endpoints of the same
        options): its ``traffic()``, ``peers()`` and flight recorder (``dump_trace``)."""
        return self._engine.transport

    def _check_open(self) -> None:
        if self._state != _OPEN:
            raise RuntimeError("this transport endpoint is closed")

    def _deadline(self, timeout: float | None) -> float:
        check_timeout(timeout)
        return self._timeout if timeout is None or timeout == 0 else float(timeout)

    def bind(self, *, timeout: float | None = None) -> bytes:
        check_timeout(timeout)
        self._check_open()
        engine = self._engine
        return EndpointUrl(engine.name, engine.generation, engine.transport.core.record()).encode()

    def connect(self, peer_url: bytes, *, timeout: float | None = None) -> int:
        check_timeout(timeout)
        url = EndpointUrl.decode(peer_url)
        with self._lock:
            self._check_open()
            if self._peer is not None:
                raise RuntimeError(
                    f"this endpoint is already connected (to {self._peer}); an endpoint has one "
                    "peer: make another endpoint for another peer (they share one engine)"
                )
            engine = self._engine
            if url.owner == engine.name:
                self._local_peer = True
            else:
                engine.admit(url.record)
            self._peer = url.owner
        return 0

    def connected(self) -> bool:
        return self._peer is not None and self._state == _OPEN

    # -- memory --------------------------------------------------------------------------------

    def register_memory(
        self, tensor: torch.Tensor, *, timeout: float | None = None
    ) -> TransportMemory:
        check_timeout(timeout)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_memory takes a torch.Tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError("register a contiguous tensor (tensor.contiguous() makes one)")
        if tensor.numel() == 0:
            raise ValueError("an empty tensor cannot be registered")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the transport backend moves CPU or CUDA memory, not {tensor.device}")
        self._check_device(tensor.device)
        data = tensor.detach().reshape(-1).view(torch.uint8)
        key = (data.data_ptr(), data.numel(), str(tensor.device))
        with self._lock:
            self._check_open()
            held = self._registrations.get(key)
            if held is not None and held.active:
                return TransportMemory(self, held, reused=True)
            registration = Registration(tensor, data, self._engine.expose(data))
            self._registrations[key] = registration
            self._mine.add(id(registration))
        return TransportMemory(self, registration, reused=False)

    def unregister_memory(self, memory: Any, *, timeout: float | None = None) -> None:
        deadline = self._deadline(timeout)
        if not isinstance(memory, TransportMemory) or memory.owner is not self:
            raise TypeError("this memory was not registered by this endpoint")
        registration = memory.registration
        with self._lock:
            self._check_open()
            if not registration.active:
                return
            if any(r is registration for _, r in self._in_flight.values()):
                raise RuntimeError(
                    "this memory has transfers in flight: wait for them before unregistering it"
                )
            registration.active = False
            self._registrations = {
                k: r for k, r in self._registrations.items() if r is not registration
            }
            self._mine.discard(id(registration))
        self._engine.withdraw([registration.region], deadline)

    def describe(self, registration: Registration, *, timeout: float | None) -> RemoteRegion:
        """The descriptor of one of our registrations (``Memory.to_remote_buffer``)."""
        check_timeout(timeout)
        self._check_open()
        registration.check()
        engine = self._engine
        return RemoteRegion(
            engine.name,
            engine.generation,
            registration.region,
            registration.length,
            engine.transport.core.record(),
        )

    # -- transfers -----------------------------------------------------------------------------

    def _check_transfer(self, local_buffer: Any, remote_buffer: Any, *, mutable: bool) -> None:
        wanted = MutableMemoryView if mutable else MemoryView
        if not isinstance(local_buffer, wanted):
            raise TypeError(
                f"the local buffer must be a {wanted.__name__} of this backend "
                f"(memory.to_{'mutable_' if mutable else ''}view()), not "
                f"{type(local_buffer).__name__}"
            )
        registration = local_buffer.registration
        if id(registration) not in self._mine:
            raise TypeError("the local buffer is a view of memory this endpoint did not register")
        registration.check()
        if not isinstance(remote_buffer, RemoteRegion):
            raise TypeError(
                "the remote buffer must be a RemoteRegion of the transport backend "
                f"(RemoteRegion.deserialize(bytes)), not {type(remote_buffer).__name__}"
            )
        if remote_buffer.owner != self._peer:
            if self._peer is None:
                raise RuntimeError("this endpoint is not connected: connect() to the peer first")
            raise ValueError(
                f"the remote buffer belongs to {remote_buffer.owner}, not to this endpoint's "
                f"peer {self._peer}"
            )
        if local_buffer.length > remote_buffer.length:
            raise ValueError(
                f"the local view ({local_buffer.length} bytes) does not fit in the remote "
                f"buffer ({remote_buffer.length} bytes)"
            )

    def _post(
        self,
        op: str,
        local_buffer: Any,
        remote_buffer: Any,
        deadline: float,
        stream: Any = None,
        track: bool = False,
    ) -> Handle | None:
        """Check and post one transfer; its handle (None: done already, or ordered on
        ``stream``). ``track``: a close waits for it."""
        with self._lock:  # a close waits for what was posted before it, and refuses the rest
            if self._state != _OPEN:
                raise RuntimeError("this transport endpoint is closed")
            self._check_transfer(local_buffer, remote_buffer, mutable=op == "read")
            view: MemoryView = local_buffer
            remote: RemoteRegion = remote_buffer
            if view.length == 0:
                return None
            if self._local_peer:
                self._copy_locally(op, view, remote, stream)
                return None
            engine = self._engine.transport
            call = engine.put if op == "write" else engine.get
            data = view.bytes()
            try:
                handle = call(data, remote.owner, remote.region, timeout=deadline, stream=stream)
            except (RegionError, PeerNotFoundError):
                # registered after we connected: the descriptor's record lists it (and an older
                # record than the peer's last withdrawal is not taken: see peers/table.py)
                peer = self._engine.admit(remote.record)
                if peer.generation != remote.generation or remote.region not in peer.regions:
                    raise ValueError(
                        f"the remote buffer names {remote.region!r} of {remote.owner}#"
                        f"{remote.generation}, which that peer no longer exposes (unregistered, "
                        "or its endpoint closed): ask it for a fresh descriptor"
                    ) from None
                handle = call(data, remote.owner, remote.region, timeout=deadline, stream=stream)
            if stream is not None:
                return None  # its failure surfaces at the next call of the engine (check())
            if track:
                self._in_flight[handle.id] = (handle, view.registration)
            return handle

    def _submit(
        self, op: str, local_buffer: Any, remote_buffer: Any, deadline: float
    ) -> TransferWork:
        handle = self._post(op, local_buffer, remote_buffer, deadline, track=True)
        return TransferWork(handle, self._done if handle is not None else None)

    def _done(self, handle: Handle) -> None:
        with self._lock:
            self._in_flight.pop(handle.id, None)

    def _copy_locally(self, op: str, view: MemoryView, remote: RemoteRegion, stream: Any) -> None:
        target = self._engine.local(remote.region)
        if target is None:
            raise ValueError(
                f"the remote buffer names {remote.region!r}, which this process no longer "
                "exposes (unregistered, or its endpoint closed): ask for a fresh descriptor"
            )
        mine = view.bytes()
        theirs = target[: view.size()]
        src, dst = (mine, theirs) if op == "write" else (theirs, mine)
        if stream is not None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            return
        dst.copy_(src)
        if dst.is_cuda or src.is_cuda:
            torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()

    def _start(
        self, op: str, local_buffer: Any, remote_buffer: Any, async_op: bool, timeout: float | None
    ) -> int | TransferWork:
        deadline = self._deadline(timeout)
        if async_op:
            return self._submit(op, local_buffer, remote_buffer, deadline)
        handle = self._post(op, local_buffer, remote_buffer, deadline)
        if handle is None:
            return 0
        if timeout == 0 and not handle.done():
            raise TimeoutError(
                "the transfer did not complete at once (timeout=0); it goes on until its "
                "deadline: wait for it with async_op=True"
            )
        handle.wait()  # its deadline ends it: done, failed, or withdrawn with TransferTimeout
        return 0

    def write(
        self,
        local_buffer: Any,
        remote_buffer: Any,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> int | TransferWork:
        return self._start("write", local_buffer, remote_buffer, async_op, timeout)

    def read(
        self,
        local_buffer: Any,
        remote_buffer: Any,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> int | TransferWork:
        return self._start("read", local_buffer, remote_buffer, async_op, timeout)

    async def _transfer_async(
        self, op: str, local_buffer: Any, remote_buffer: Any, timeout: float | None
    ) -> None:
        handle = self._post(op, local_buffer, remote_buffer, self._deadline(timeout), track=True)
        if handle is not None:
            await handle  # ends by the transfer's deadline; a cancelled wait cancels nothing

    async def write_async(
        self, local_buffer: Any, remote_buffer: Any, *, timeout: float | None = None
    ) -> None:
        await self._transfer_async("write", local_buffer, remote_buffer, timeout)

    async def read_async(
        self, local_buffer: Any, remote_buffer: Any, *, timeout: float | None = None
    ) -> None:
        await self._transfer_async("read", local_buffer, remote_buffer, timeout)

    def write_stream(
        self,
        local_buffer: Any,
        remote_buffer: Any,
        *,
        stream: Any = None,
        timeout: float | None = None,
    ) -> None:
        self._stream_transfer("write", local_buffer, remote_buffer, stream, timeout)

    def read_stream(
        self,
        local_buffer: Any,
        remote_buffer: Any,
        *,
        stream: Any = None,
        timeout: float | None = None,
    ) -> None:
        self._stream_transfer("read", local_buffer, remote_buffer, stream, timeout)

    def _stream_transfer(
        self, op: str, local_buffer: Any, remote_buffer: Any, stream: Any, timeout: float | None
    ) -> None:
        check_timeout(timeout)
        if timeout == 0:
            raise ValueError("stream transfers need a positive timeout (their deadline)")
        stream = stream if stream is not None else torch.cuda.current_stream()
        self._post(op, local_buffer, remote_buffer, self._deadline(timeout), stream=stream)

    # -- closing -------------------------------------------------------------------------------

    def close(self, *, timeout: float | None = None) -> None:
        budget = self._deadline(timeout)
        end = time.monotonic() + budget
        in_flight = self._begin_close()
        if in_flight is None:
            return
        for handle in in_flight:
            left = end - time.monotonic()
            if not handle.done() and left > 0:
                _wait_quietly(handle, left)
        if not all(handle.done() for handle in in_flight):
            raise _still_in_flight(budget)
        self._release(max(end - time.monotonic(), 1e-3))

    async def close_async(self, *, timeout: float | None = None) -> None:
        budget = self._deadline(timeout)
        end = time.monotonic() + budget
        in_flight = self._begin_close()
        if in_flight is None:
            return
        if in_flight:
            waits = [asyncio.ensure_future(_settled(h)) for h in in_flight]
            _, pending = await asyncio.wait(waits, timeout=budget)
            if pending:
                for w in pending:
                    w.cancel()
                raise _still_in_flight(budget)
        self._release(max(end - time.monotonic(), 1e-3))

    def _begin_close(self) -> list[Handle] | None:
        """Refuse new work; the transfers a close waits for (None: closed already)."""
        with self._lock:
            if self._state == _CLOSED:
                return None
            self._state = _CLOSING
            return [h for h, _ in self._in_flight.values()]

    def _release(self, timeout: float) -> None:
        with self._lock:
            if self._state == _CLOSED:
                return
            regions = [r.region for r in self._registrations.values() if r.active]
            for registration in self._registrations.values():
                registration.active = False
            self._registrations.clear()
            self._mine.clear()
            self._state = _CLOSED
            self._peer = None
        try:
            self._engine.withdraw(regions, timeout)
        finally:
            self._engine.release()

    def __repr__(self) -> str:
        return f"TorchTransport({self._engine.name}, peer={self._peer}, {self._state})"


def _still_in_flight(budget: float) -> TimeoutError:
    return TimeoutError(
        f"close waited {budget:.3g} s and transfers of this endpoint are still in flight; "
        "nothing was released: retry close()"
    )


def _wait_quietly(handle: Handle, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``handle`` to end; its error is its Work's to report."""
    try:
        handle.wait(timeout)
    except Exception:
        return


async def _settled(handle: Handle) -> None:
    try:
        await handle
    except Exception:  # its Work reports it; close only waits for the end
        return
