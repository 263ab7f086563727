"""Stream-ordered puts, gets and publishes on CUDA streams, capturable in CUDA graphs.

``StreamOps`` belongs to one Transport and is created on the first ``stream=`` call. For each
operation it keeps a slot (see ``proxy``): enqueuing the operation launches the ring kernel on the
stream; ``StreamHandle.wait_stream(s)`` launches the wait kernel on ``s``. Inside
``torch.cuda.graph`` capture the two kernels are recorded like any other, and every replay rings
again (the sequence counter is in memory the kernel increments, not a kernel argument). The
kernels come from ``csrc/stream_ops.cu``, compiled at run time with NVRTC through CuPy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from transport.cuda.proxy import BELL, DONE, FAILED, GAVE_UP, Proxy, Slot

#: slots per Transport (four 8-byte words and one counter of pinned memory each)
CAPACITY = 4096
#: how long a stream waits for a transfer before it gives up (and the host raises)
DEFAULT_STREAM_TIMEOUT = 60.0


def unavailable() -> str | None:
    """Why stream-ordered transfers cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return (
            "stream= orders transfers on a CUDA stream, and this process has no CUDA device "
            "(torch.cuda.is_available() is False); call put() without stream= and wait on the handle"
        )
    try:
        import cupy  # noqa: F401
    except ImportError:
        return (
            "stream= compiles its kernels with CuPy, which is not installed: "
            "pip install 'transport[cuda]' (or cupy-cuda12x / cupy-cuda13x to match your CUDA)"
        )
    return None


def kernel_source() -> str:
    """csrc/stream_ops.cu, from the installed package or the source tree."""
    try:
        return (resources.files("transport.csrc") / "stream_ops.cu").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parents[2] / "csrc" / "stream_ops.cu").read_text()


class _Kernels:
    """The kernels of ``csrc/stream_ops.cu``: one CuPy RawModule for the whole process (class
    state, shared by every StreamOps), made under ``_lock`` on the first launch and kept until the
    process exits. CuPy compiles it with NVRTC when its first kernel is fetched, so the first
    stream-ordered call of the process pays for the compile, on the calling thread, and a kernel
    that does not compile raises there.
    """

    _lock = threading.Lock()
    _module: Any = None

    @classmethod
    def get(cls) -> Any:
        with cls._lock:
            if cls._module is None:
                import cupy

                cls._module = cupy.RawModule(code=kernel_source(), options=("--std=c++17",))
            return cls._module


def _launch(name: str, stream: torch.cuda.Stream, *args: int) -> None:
    import cupy
    import numpy as np

    fn = _Kernels.get().get_function(name)
    with cupy.cuda.Device(stream.device.index):
        fn((1,), (1,), tuple(np.uint64(a) for a in args), stream=_cupy_stream(cupy, stream))


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream) -> Any:
    """``stream`` as CuPy's: through the CUDA stream protocol where CuPy has it (14 and later,
    where ``ExternalStream`` is deprecated), else by its handle."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _device_address(cupy: Any, pinned: torch.Tensor) -> int:
    """Where the device sees ``pinned`` (page-locked host memory). With unified addressing (every
    64-bit CUDA platform) that is the host address; ask the runtime where it can be asked."""
    ptr = pinned.data_ptr()
    get = getattr(cupy.cuda.runtime, "hostGetDevicePointer", None)
    try:
        return int(get(ptr, 0)) if get is not None else ptr
    except Exception:
        return ptr


class StreamHandle:
    """What a ``stream=`` put, get or publish returns: :meth:`wait_stream` holds a stream until
    the transfer has ended, without blocking the host; :meth:`wait` blocks the host (eager only)."""

    def __init__(self, ops: SlotTable, slot: Slot, seq: int | None, stream: Any) -> None:
        self._ops, self._slot, self._seq, self._stream = ops, slot, seq, stream

    def wait_stream(self, stream: Any = None, timeout: float | None = None) -> None:
        """Later work on ``stream`` (default: the stream of the operation) starts only after the
        transfer ended. After ``timeout`` seconds (default 60) the stream stops waiting and the
        host raises TransferTimeout at its next check."""
        stream = self._stream if stream is None else stream
        if stream is not self._stream and isinstance(stream, torch.cuda.Stream):
            ev = torch.cuda.Event()
            ev.record(self._stream)
            stream.wait_event(ev)
        t = DEFAULT_STREAM_TIMEOUT if timeout is None else timeout
        self._ops.wait_kernel(self._slot, stream, t)

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until the transfer ended (raises its error). Not inside a captured
        graph: there the replays, not this call, issue the transfers."""
        if self._seq is None:
            raise RuntimeError(
                "a captured operation has no host-side wait: use wait_stream() inside the graph, "
                "or synchronize the stream after replay() and call Transport.check()"
            )
        self._ops.proxy.wait_done(self._slot, self._seq, timeout)

    def done(self) -> bool:
        return self._seq is not None and self._ops.proxy.word(self._slot, DONE) >= self._seq

    def failed(self) -> bool:
        return self._seq is not None and self._ops.proxy.word(self._slot, FAILED) >= self._seq


class SlotTable:
    """Slots by operation: the same put (same tensors, peer, keys) on the same stream reuses its
    slot, inside and outside graph capture alike. Subclasses ring and wait."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words
        self.proxy = Proxy(words)
        self._slots: dict[tuple[Any, ...], Slot] = {}
        self._lock = threading.Lock()

    def capturing(self) -> bool:
        return False

    def ring(self, slot: Slot, stream: Any) -> None:
        raise NotImplementedError

    def wait_kernel(self, slot: Slot, stream: Any, timeout: float) -> None:
        raise NotImplementedError

    def stream_id(self, stream: Any) -> Any:
        return id(stream)

    def enqueue(
        self, key: tuple[Any, ...], start: Callable[[], Any], what: str, stream: Any
    ) -> StreamHandle:
        """Ring the slot of ``key`` on ``stream`` (a new slot on first use)."""
        captured = self.capturing()
        full = (*key, self.stream_id(stream), captured)
        with self._lock:
            slot = self._slots.get(full)
            if slot is None:
                slot = self._slots[full] = self.proxy.add(start, what, captured)
            else:
                slot.start = start
        self.ring(slot, stream)
        seq = None
        if not captured:
            slot.rings += 1
            seq = slot.rings
        return StreamHandle(self, slot, seq, stream)

    def check(self) -> None:
        self.proxy.check()

    def close(self) -> None:
        self.proxy.close()


class StreamOps(SlotTable):
    """The CUDA implementation: pinned words and counters that the GPU reads and writes through
    unified addressing, and the kernels of csrc/stream_ops.cu. Nothing of it is device memory, so
    creating it inside a graph capture records nothing into the graph."""

    def __init__(self) -> None:
        import cupy

        super().__init__(torch.zeros((CAPACITY, 4), dtype=torch.int64, pin_memory=True))
        # The counters are pinned host memory too, zeroed here by the CPU: the first stream= call
        # may come inside a graph capture, where a device tensor's zero-fill would be captured
        # and every replay would reset its counter (each replay would ring the same number, which
        # the proxy takes as already answered).
        self.counters = torch.zeros(CAPACITY, dtype=torch.int64, pin_memory=True)
        self._words_at = _device_address(cupy, self.words)
        self._counters_at = _device_address(cupy, self.counters)

    def _word_ptr(self, slot: Slot, which: int) -> int:
        return self._words_at + (slot.index * 4 + which) * 8

    def _counter_ptr(self, slot: Slot) -> int:
        return self._counters_at + slot.index * 8

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def stream_id(self, stream: Any) -> Any:
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        return stream.cuda_stream

    def ring(self, slot: Slot, stream: Any) -> None:
        _launch("transport_ring", stream, self._counter_ptr(slot), self._word_ptr(slot, BELL))

    def wait_kernel(self, slot: Slot, stream: Any, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        _launch(
            "transport_wait",
            stream,
            self._counter_ptr(slot),
            self._word_ptr(slot, DONE),
            self._word_ptr(slot, GAVE_UP),
            int(timeout * 1e9),
        )
