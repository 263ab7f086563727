"""A version streamed through a bounded staging area, part by part, into vLLM's reload.

When not even one staging copy of what a worker keeps fits within its staging bound and vLLM does
not compute with its parameters as stored (so it cannot be written in place), the version comes
in **parts**: the worker's layout cut, in its own order, into parts of at most half the bound,
received into two buckets in turn. Part ``k`` is a group of its own (:func:`part_group`; part 0
is the worker's group, where the trainer finds it) with a
:class:`~transport.weights.WindowedSubscriber` over views of bucket ``k % 2``; its window opens
while part ``k - 1`` loads from the other bucket, so transfer and loading overlap, and a bucket is
written again only after the part it held was loaded. The trainer publishes every part's group
at once, each waits for its window.

All parts of a version go into one vLLM layerwise reload inside ``finish_weight_update``: a layer
is rebuilt (and processed as after vLLM's own load) once its last part landed. A version is
therefore not whole before it reaches the model: a trainer that dies mid-stream leaves the
layers of the parts that loaded with the new version and the rest with the old one, and the
worker says so (:class:`Streamed`, the mode itself).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from transport import Transport
from transport.integrations.vllm.modes.base import Held, Worker, WrittenInFinish
from transport.integrations.vllm.modes.loading import load_version
from transport.integrations.vllm.shards import WorkerLayout
from transport.weights import WindowedSubscriber

#: where each tensor of a bucket starts: a multiple of this many bytes
ALIGN = 64


def part_group(group: str, part: int) -> str:
    """The weight group of part ``part`` of a streamed version of ``group``."""
    return group if part == 0 else f"{group}.part{part}"


def plan_parts(layout: WorkerLayout, bucket: int) -> list[list[str]]:
    """The layout's tensors, in its order, cut into parts of at most ``bucket`` bytes each
    (aligned as they lie in a bucket); ValueError naming a tensor larger than a bucket."""
    parts: list[list[str]] = [[]]
    used = 0
    for name, d in layout.dest.items():
        nbytes = _aligned(math.prod(d.shape) * d.dtype.itemsize)
        if nbytes > bucket:
            raise ValueError(
                f"tensor {name} ({nbytes / 2**20:.4g} MiB) is larger than one bucket of a streamed "
                f"version ({bucket / 2**20:.4g} MiB: half of the staging bound); raise staging_gb to "
                f"at least {2 * nbytes / 2**30:.4g} GiB"
            )
        if used + nbytes > bucket:
            parts.append([])
            used = 0
        parts[-1].append(name)
        used += nbytes
    return parts


class Stream:
    """One worker's parts of every streamed version. It owns the two buckets (flat buffers on
    the staging device) and one WindowedSubscriber per part, over views of the bucket of its
    parity. Rules: parts are received in order, one window open ahead of the part loading (in
    the other bucket); :meth:`parts` shuts that window if the caller stops early; :meth:`close`
    closes every subscriber (the Transport stays the caller's)."""

    def __init__(
        self,
        transport: Transport,
        layout: WorkerLayout,
        group: str,
        device: torch.device | str,
        source_shapes: Mapping[str, Sequence[int]],
        bucket: int,
    ) -> None:
        self.names = plan_parts(layout, bucket)
        sizes = [sum(_aligned(_nbytes(layout, n)) for n in part) for part in self.names]
        self.buckets = [
            torch.empty(max(sizes[k::2], default=0), dtype=torch.uint8, device=device)
            for k in range(2)
        ]
        self.subscribers: list[WindowedSubscriber] = []
        try:
            for k, names in enumerate(self.names):
                views = _carve(self.buckets[k % 2], layout, names)
                self.subscribers.append(
                    WindowedSubscriber(
                        transport,
                        views,
                        group=part_group(group, k),
                        layout={n: layout.dest[n] for n in names},
                        source_shapes=source_shapes,
                    )
                )
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        """The staging memory of the two buckets."""
        return sum(b.numel() for b in self.buckets)

    @property
    def torn(self) -> int | None:
        """A version one of the parts began and did not complete (None: none)."""
        return max((t for s in self.subscribers if (t := s.torn) is not None), default=None)

    @contextlib.contextmanager
    def parts(self, version: int, timeout: float) -> Iterator[Iterator[Mapping[str, torch.Tensor]]]:
        """Yields an iterator of the parts of ``version`` as each lands (views of its bucket,
        valid until the next part is asked for); the whole stream within ``timeout`` seconds.
        A part that does not land raises from the iterator (TransferTimeout, which says whether
        that part's tensors are torn)."""
        deadline = time.monotonic() + timeout
        pool = ThreadPoolExecutor(1, thread_name_prefix="transport-vllm-stream")
        ahead: list[tuple[WindowedSubscriber, Future[int]]] = []

        def receive(k: int) -> None:
            sub = self.subscribers[k]
            left = max(deadline - time.monotonic(), 1e-3)
            ahead.append((sub, pool.submit(sub.receive, version, left)))

        def each() -> Iterator[Mapping[str, torch.Tensor]]:
            receive(0)
            for k, sub in enumerate(self.subscribers):
                _, landed = ahead.pop()
                landed.result()
                if k + 1 < len(self.subscribers):
                    receive(k + 1)  # its bucket is not the one this part lies in
                yield sub.live

        try:
            yield each()
        finally:
            for sub, landed in ahead:  # the caller stopped early: shut the window ahead
                sub.shut()
                with contextlib.suppress(Exception):
                    landed.result()
            pool.shutdown()

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()
        self.subscribers = []
        self.buckets = []


class Streamed(WrittenInFinish):
    """A :class:`Stream` of buckets of half the staging bound each. Rules: its publishers write
    only inside ``finish_weight_update``, the version ``receive`` named, part by part into one
    layerwise reload; a stream that stops after some parts loaded leaves the model torn."""

    name = "streamed"

    def __init__(self, worker: Worker, layout: WorkerLayout) -> None:
        super().__init__(worker, layout)
        shapes = {n: tuple(x.shape) for n, x in worker.spec.items()}
        self.stream = Stream(
            worker.transport,
            layout,
            worker.info.group,
            worker.staging,
            shapes,
            worker.room.bound // 2,
        )
        self.subscriber = self.stream.subscribers[0]

    @property
    def said(self) -> str:
        return f"streamed:{len(self.stream.names)}"

    @property
    def group(self) -> str:
        return self.subscriber.group

    @property
    def need(self) -> int:
        return self.stream.nbytes

    def finish(self) -> int | None:
        wanted = self.take()
        if wanted is None:
            return None
        assert wanted.version is not None
        count = len(self.stream.names)
        with self.stream.parts(wanted.version, wanted.timeout) as parts:
            load_version(self.worker, self.layout, parts, wanted.version, count)
        return wanted.version

    def held(self) -> Held:
        sub = self.subscriber
        storages = {}
        for bucket in self.stream.buckets:
            storages[bucket.untyped_storage().data_ptr()] = bucket.untyped_storage().nbytes()
        return Held(
            complete=sub.version,
            incomplete=sub.incomplete,
            nbytes=sum(storages.values()),
            parts=len(self.stream.names),
        )

    def close(self) -> None:
        self.drop()
        self.stream.close()


def _nbytes(layout: WorkerLayout, name: str) -> int:
    d = layout.dest[name]
    return math.prod(d.shape) * d.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _carve(bucket: torch.Tensor, layout: WorkerLayout, names: list[str]) -> dict[str, torch.Tensor]:
    """Views of ``bucket``, one per tensor of ``names``, packed in order."""
    out, at = {}, 0
    for name in names:
        d = layout.dest[name]
        n = _nbytes(layout, name)
        out[name] = bucket[at : at + n].view(d.dtype).view(d.shape)
        at += _aligned(n)
    return out
