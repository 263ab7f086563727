"""Prepared transfers: what a put or get to one peer becomes before it is posted.

A :class:`Plan` holds the prepared local and remote descriptor lists of one
(op, peer, source, destination) combination, split into parts of at most
``chunk_bytes`` so that one huge post never holds the agent for long, and a
pool of reusable backend transfers per part. Plans are cached by the
Transport's plan cache (plan_cache.py), so a repeated put replays a plan without planning;
:func:`build_plan` makes one, checking every rule of a transfer first.
Plans target a :class:`~transport.peers.conn.PeerConn` (peers/conn.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from transport.backends.base import READ, WRITE, Backend, device_parts
from transport.errors import RegionError, TransportError
from transport.gc_pause import without_gc
from transport.memory.local import LocalMemory, Registration, check_tensor, device_of, dtype_name
from transport.peers.conn import PeerConn
from transport.transfers.batch import Offset
from transport.wire import RegionInfo

if TYPE_CHECKING:
    import torch


log = logging.getLogger(__name__)


class Part:
    """A contiguous range of a plan's descriptors, posted as one backend transfer."""

    __slots__ = ("count", "idle", "index", "nbytes")

    def __init__(self, index: np.ndarray, nbytes: int) -> None:
        self.index = index
        self.count = len(index)
        self.nbytes = nbytes
        # idle[False]: transfers made without a notification, idle[True]: with one (a pooled transfer
        # keeps the notification it was made with unless a new one is passed when posting)
        self.idle: dict[bool, list[Any]] = {False: [], True: []}


@dataclass(frozen=True)
class Descriptors:
    """What a plan was made from, kept to cut the same transfer over lanes: the local and remote
    descriptor rows (address, length, device id), the memory kinds of both ends, and the chunk
    size of its parts."""

    local: np.ndarray
    remote: np.ndarray
    device: str
    remote_device: str
    chunk_bytes: int

    @property
    def host_only(self) -> bool:
        """Host memory at both ends (the only transfers lanes take)."""
        return self.device == "cpu" and self.remote_device == "cpu"


class Plan:
    """A prepared transfer to one peer, replayable any number of times (one use at a time per
    part; concurrent uses make extra backend transfers)."""

    def __init__(
        self,
        backend: Backend,
        conn: PeerConn,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        device: str,
        remote_device: str,
        chunk_bytes: int,
        keep: tuple[Any, ...],
        head: int = 0,
        tail: int = 0,
    ) -> None:
        self.conn = conn
        self.op = op
        self.backend = backend
        self.keep = keep  # registrations (and tensors) that must outlive the plan
        local, remote = coalesce(
            local,
            remote,
            [r.base for r in keep if isinstance(r, Registration)],
            [addr for addr, _, _ in conn.record.registrations],
        )
        self.rows = Descriptors(local, remote, device, remote_device, chunk_bytes)
        self.shares: list[Plan] | None = None  # the same transfer cut over lanes (lanes.py)
        local, remote, bounds = split_descs(local, remote, chunk_bytes, head, tail)
        self.nbytes = int(local[:, 1].sum()) if len(local) else 0
        self.valid = True  # False: no new use (released, or its region was withdrawn)
        self.released = False
        self.regions: frozenset[str] = frozenset()  # the remote regions it writes or reads
        self.inline = False  # small and in one part: posted from the caller's thread
        self.busy = 0  # transfers in flight (guarded by conn.lock)
        self.claims = 0  # transfers made on it and not completed, posted or not (conn.lock)
        self.local = backend.prep(None, local, device)
        try:
            self.remote = backend.prep(conn.agent, remote, remote_device)
        except BaseException:
            backend.release_prepped(self.local)
            raise
        self.parts = [
            Part(np.arange(a, b, dtype=np.int32), int(local[a:b, 1].sum())) for a, b in bounds
        ]
        # a one-part plan the backend can run inside a call (Backend.direct): the fast path's
        try:
            self.direct = (
                backend.direct(
                    op, self.local, self.parts[0].index, self.remote, self.parts[0].index, conn.name
                )
                if len(self.parts) == 1
                else None
            )
        except BaseException:
            backend.release_prepped(self.local)
            backend.release_prepped(self.remote)
            raise

    @property
    def in_flight(self) -> int:
        """Transfers in flight on this plan or on its shares over lanes, or still to be posted."""
        return self.busy + self.claims + sum(s.busy for s in self.shares or ())

    def take(self, backend: Backend, part: Part, notif: bytes) -> Any:
        """A backend transfer for ``part``: an idle one from the pool, or a new one."""
        pool = part.idle[bool(notif)]
        if pool:
            try:
                return pool.pop()
            except IndexError:  # another thread took the last one
                pass
        return backend.make_xfer(
            self.op, self.local, part.index, self.remote, part.index, notif, self.conn.name
        )

    def give_back(self, backend: Backend, part: Part, xfer: Any, notified: bool) -> None:
        """Return a completed transfer to the pool (or release it if the plan is gone).
        Call with ``conn.lock`` held."""
        self.account(part.nbytes)
        pool = part.idle[notified]
        if self.valid and len(pool) < 4:
            pool.append(xfer)
        else:
            backend.release_xfer(xfer)

    def run_direct(self) -> bool:
        """Run the plan's direct transfer (Backend.direct) under its connection's lock, as a post
        (a withdrawn region's plan is never run again), and count its bytes. False: it has none,
        the plan was withdrawn, the peer lost, or the run failed (the general path posts it again
        and reports why)."""
        conn = self.conn
        with conn.lock:
            direct = self.direct
            if direct is None or not self.valid or not conn.alive:
                return False
            try:
                direct()
            except TransportError:
                return False
            self.account(self.nbytes)
        return True

    def account(self, nbytes: int) -> None:
        """Count ``nbytes`` moved in the connection's traffic. Call with ``conn.lock`` held."""
        if self.op == READ:
            self.conn.traffic.read += nbytes
        else:
            self.conn.traffic.written += nbytes

    def release(self, backend: Backend) -> None:
        if self.released:
            return
        self.released = True
        self.valid = False
        self.direct = None
        for share in self.shares or ():  # the same transfer cut over lanes: each on its agent
            # the caller holds this plan's connection lock; a lane's share has its own
            with share.conn.lock if share.conn is not self.conn else contextlib.nullcontext():
                share.conn.plans.discard(share)
                share.release(share.backend)
        for part in self.parts:
            for pool in part.idle.values():
                while pool:
                    backend.release_xfer(pool.pop())
        backend.release_prepped(self.local)
        backend.release_prepped(self.remote)
        for reg in self.keep:
            reg.users -= 1


def coalesce(
    local: np.ndarray, remote: np.ndarray, local_regs: list[int], remote_regs: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Paired descriptor rows with every run of rows that are adjacent at both ends, on the same
    devices and inside one registration at each end (``*_regs``: the start addresses of the
    registered memory) merged into one: tensors laid out in the same order in flat buffers on
    both sides (a model's parameters, a subscriber's staging slots) become a handful of
    descriptors. Nothing is merged when a side's registrations are unknown; no byte outside a
    row is added."""
    if len(local) < 2 or not local_regs or not remote_regs:
        return local, remote
    ends_l, ends_r = local[:-1, 0] + local[:-1, 1], remote[:-1, 0] + remote[:-1, 1]
    joins = (
        (ends_l == local[1:, 0])
        & (ends_r == remote[1:, 0])
        & (local[:-1, 2] == local[1:, 2])
        & (remote[:-1, 2] == remote[1:, 2])
    )
    if not joins.any():
        return local, remote
    for rows, regs in ((local, local_regs), (remote, remote_regs)):
        starts = np.array(sorted(regs), dtype=np.uint64)
        span = np.searchsorted(starts, rows[:, 0], side="right")
        joins &= span[:-1] == span[1:]  # adjacent memory of two registrations stays two rows
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    lens = np.add.reduceat(local[:, 1], first).astype(np.uint64)
    merged_l = np.stack([local[first, 0], lens, local[first, 2]], axis=1).astype(np.uint64)
    merged_r = np.stack([remote[first, 0], lens, remote[first, 2]], axis=1).astype(np.uint64)
    return merged_l, merged_r


def split_descs(
    local: np.ndarray, remote: np.ndarray, chunk: int, head: int = 0, tail: int = 0
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Split paired descriptor lists into parts of at most ``chunk`` bytes.

    Descriptors larger than ``chunk`` are cut into pieces; small ones are grouped. With ``head``
    or ``tail``, the first or last part is exactly that many bytes (a row is cut there), when
    what is left between them is not empty.
    Returns the (possibly longer) lists and the [start, end) row range of each part.
    """
    total = int(local[:, 1].sum()) if len(local) else 0
    if (head or tail) and head + tail < total:
        runs: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]] = []
        if head:
            hl, hr, local, remote = _cut_at(local, remote, head)
            runs.append((hl, hr, [(0, len(hl))]))
        if tail:
            local, remote, tl, tr = _cut_at(local, remote, total - head - tail)
        runs.append(split_descs(local, remote, chunk))
        if tail:
            runs.append((tl, tr, [(0, len(tl))]))
        spans: list[tuple[int, int]] = []
        at = 0
        for lo, _, bs in runs:
            spans.extend((a + at, b + at) for a, b in bs)
            at += len(lo)
        return np.concatenate([r[0] for r in runs]), np.concatenate([r[1] for r in runs]), spans
    lens = local[:, 1].astype(np.int64)
    if len(lens) == 0:
        return local, remote, [(0, 0)]
    if int(lens.sum()) <= chunk:
        return local, remote, [(0, len(lens))]
    if int(lens.max()) > chunk:
        pieces = np.maximum(1, -(-lens // chunk))
        rows = np.repeat(np.arange(len(lens)), pieces)
        first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
        k = np.arange(len(rows)) - np.repeat(first, pieces)
        off = (k * chunk).astype(np.uint64)
        n = np.minimum(lens[rows] - k * chunk, chunk).astype(np.uint64)
        new_local = np.stack([local[rows, 0] + off, n, local[rows, 2]], axis=1).astype(np.uint64)
        new_remote = np.stack([remote[rows, 0] + off, n, remote[rows, 2]], axis=1).astype(np.uint64)
        local, remote, lens = new_local, new_remote, n.astype(np.int64)
    bounds = []
    start, acc = 0, 0
    for i, n in enumerate(lens.tolist()):
        if acc and acc + n > chunk:
            bounds.append((start, i))
            start, acc = i, 0
        acc += n
    bounds.append((start, len(lens)))
    return local, remote, bounds


def _cut_at(
    local: np.ndarray, remote: np.ndarray, at: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Paired rows before and after byte ``at`` (0 < at < total), a row cut in two there."""
    ends = np.cumsum(local[:, 1].astype(np.int64))
    i = int(np.searchsorted(ends, at, side="left"))  # the row holding byte at - 1
    into = at - (int(ends[i - 1]) if i else 0)
    ll, lr = local[: i + 1].copy(), remote[: i + 1].copy()
    ll[i, 1] = lr[i, 1] = into
    rl, rr = local[i:].copy(), remote[i:].copy()
    rl[0, 0] += np.uint64(into)
    rr[0, 0] += np.uint64(into)
    rl[0, 1] -= np.uint64(into)
    rr[0, 1] = rl[0, 1]
    if rl[0, 1] == 0:
        rl, rr = rl[1:], rr[1:]
    return ll, lr, rl, rr


@without_gc
def build_plan(
    backend: Backend,
    mem: LocalMemory,
    conn: PeerConn,
    op: str,
    items: tuple[tuple[str, torch.Tensor], ...],
    offset: Offset,
    chunk_bytes: int,
) -> Plan:
    """Check a put or get of ``items`` (region name, tensor) at ``offset`` elements (one for
    all, or one per item) against ``conn``'s regions and make its plan; every rule is checked
    here, before any byte moves. Each rule is checked over all items at once (a batch of
    100,000 tensors is planned for each peer it goes to), and the first item that breaks it
    is named."""
    keys = [key for key, _ in items]
    tensors = [t for _, t in items]
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"dict keys must be region names (str), got {type(key).__name__}")
    for key, t in items:
        try:
            check_tensor(t)
        except (TypeError, ValueError):
            check_tensor(t, f"tensor {key!r}")  # the same error, naming the tensor
    regions = [conn.regions.get(key) for key in keys]
    for key, region in zip(keys, regions, strict=True):
        if region is None:
            raise RegionError(_missing_region(conn, key))
    found = cast("list[RegionInfo]", regions)
    allowed = "w" if op == WRITE else "r"
    for key, region in zip(keys, found, strict=True):
        if allowed not in region.access:
            _check_access(op, conn, key, region)
    for key, t, region in zip(keys, tensors, found, strict=True):
        if dtype_name(t.dtype) != region.dtype:
            dt = dtype_name(t.dtype)
            raise RegionError(
                f"dtype mismatch for region {key!r} of peer {conn.name!r}: the tensor is {dt}, the region "
                f"is {region.dtype}; convert with .to(torch.{region.dtype}) or view the bytes with .view()"
            )
    ats = (
        np.full(len(items), offset, np.int64)
        if isinstance(offset, int)
        else np.array(offset, np.int64)
    )
    starts = ats * np.fromiter((r.itemsize for r in found), np.int64, len(found))
    nbytes = np.fromiter((t.nbytes for t in tensors), np.int64, len(tensors))
    over = np.flatnonzero(
        starts + nbytes > np.fromiter((r.nbytes for r in found), np.int64, len(found))
    )
    if len(over):
        i = int(over[0])
        key, t, region = keys[i], tensors[i], found[i]
        raise RegionError(
            f"{t.numel()} elements at offset {int(ats[i])} do not fit region {key!r} of peer {conn.name!r} "
            f"({region.numel} elements of {region.dtype}, shape {list(region.shape)}); "
            "send a smaller slice or a smaller offset"
        )
    moving = np.flatnonzero(nbytes > 0).tolist()
    if not moving:
        raise ValueError("every tensor is empty; there is nothing to transfer")
    rdevices = {found[i].device for i in moving}
    # per storage: its registration (acquired once however many tensors view it) and device
    storages: dict[int, torch.Tensor] = {}
    for i in moving:
        storages.setdefault(tensors[i].untyped_storage().data_ptr(), tensors[i])
    devices = {device_of(t) for t in storages.values()}
    if (
        len({device_parts(d)[0] for d in devices}) > 1
        or len({device_parts(d)[0] for d in rdevices}) > 1
    ):
        raise ValueError("one transfer cannot mix CPU and CUDA memory; split the batch by device")
    keep: list[Registration] = []
    try:
        for t in storages.values():
            keep.append(mem.acquire(t))
        local_dev = {d: device_parts(d)[1] for d in devices}
        remote_dev = {d: device_parts(d)[1] for d in rdevices}
        local = np.array(
            [
                (
                    tensors[i].data_ptr(),
                    tensors[i].nbytes,
                    local_dev[device_of(tensors[i])],
                )
                for i in moving
            ],
            dtype=np.uint64,
        ).reshape(-1, 3)
        remote = np.array(
            [(found[i].addr, 0, remote_dev[found[i].device]) for i in moving], dtype=np.uint64
        ).reshape(-1, 3)
        remote[:, 0] += starts[moving].astype(np.uint64)
        remote[:, 1] = local[:, 1]
        device = "cpu" if devices == {"cpu"} else "cuda:0"
        rdevice = "cpu" if rdevices == {"cpu"} else "cuda:0"
        plan = Plan(backend, conn, op, local, remote, device, rdevice, chunk_bytes, tuple(keep))
    except BaseException:
        for reg in keep:
            reg.users -= 1
        raise
    plan.regions = frozenset(keys)
    return plan


def _check_access(op: str, conn: PeerConn, key: str, region: RegionInfo) -> None:
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


def _missing_region(conn: PeerConn, key: str) -> str:
    names = list(conn.regions)
    if not names:
        return f"peer {conn.name!r} has no region {key!r}; it exposes no regions yet"
    return (
        f"peer {conn.name!r} has no region {key!r}; it exposes {len(names)} regions, e.g. {names[0]!r}"
        + (f", {names[1]!r}" if len(names) > 1 else "")
    )
