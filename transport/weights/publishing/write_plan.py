"""What one rank writes into one slot of one subscriber, planned once and replayed every version:
runs of the same dtype straight from the shards, and converted data through a bounded pool of
staging buffers (another float dtype, or fp8 e4m3 with its scales)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from transport import Batch
from transport.contract import make_batch
from transport.weights.layouts import Box, DestTensor, Run
from transport.weights.layouts.convert import FP8, FP8_MAX, fp8_blockwise
from transport.weights.layouts.rules import scale_shape

#: a write: (region name, tensor, offset in elements of the region)
Item = tuple[str, torch.Tensor, int]


@dataclass(frozen=True)
class Chunk:
    """Converted data of one slot: ``fill`` (in order) converts the sources into pool buffer
    ``buffer``; ``batch`` then writes them to the subscriber (``items``: what it writes)."""

    buffer: int
    fill: tuple[Callable[[], object], ...]
    batch: Batch
    items: tuple[Item, ...]


@dataclass(frozen=True)
class SlotWrites:
    """What a rank writes into one slot of one subscriber for every version: ``direct`` (runs of
    the same dtype, straight from the shards; None if there are none; ``direct_items``: what it
    writes) and ``chunks`` (converted through the pool, in order); ``nbytes`` in all."""

    direct: Batch | None
    chunks: tuple[Chunk, ...]
    nbytes: int
    direct_items: tuple[Item, ...] = ()


class WritePlanner:
    """Plans the writes of one slot. It owns the chunk being filled: a place in the pool buffer
    ``len(chunks) % len(pool)`` with the fills and writes that use it. Chunk ``i`` reuses the
    buffer of chunk ``i - len(pool)``, so the sender waits for that chunk's write to land before
    it converts into it: memory for conversions stays within the pool (plus a conversion's
    temporaries, a fraction of one chunk)."""

    def __init__(self, pool: Sequence[torch.Tensor], key: Callable[[str], str]) -> None:
        self.pool, self.key = pool, key
        self.chunk_bytes = pool[0].numel()
        self.direct: list[Item] = []
        self.chunks: list[Chunk] = []
        self.fill: list[Callable[[], object]] = []
        self.items: list[Item] = []
        self.used = self.nbytes = 0

    def take(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """``nbytes`` of the current chunk (a new one when it is full), viewed as ``dtype``."""
        size = torch.empty(0, dtype=dtype).element_size()
        at = -(-self.used // size) * size  # aligned for the dtype
        if at + nbytes > self.chunk_bytes:
            self.close()
            at = 0
        self.used = at + nbytes
        self.nbytes += nbytes
        return self.pool[len(self.chunks) % len(self.pool)][at : at + nbytes].view(dtype)

    def room(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` still free in the current chunk (0: start a new one)."""
        size = torch.empty(0, dtype=dtype).element_size()
        return max(0, (self.chunk_bytes - -(-self.used // size) * size) // size)

    def close(self) -> None:
        if self.items:
            buffer = len(self.chunks) % len(self.pool)
            batch = make_batch(self.items)
            self.chunks.append(Chunk(buffer, tuple(self.fill), batch, tuple(self.items)))
        self.fill, self.items, self.used = [], [], 0

    def run(self, r: Run, src: torch.Tensor, dtype: torch.dtype) -> None:
        """Run ``r`` from flat local tensor ``src`` into a destination of ``dtype``."""
        if dtype == src.dtype:
            self.direct.append((self.key(r.dest), src[r.src_at : r.src_at + r.count], r.dst_at))
            self.nbytes += r.count * src.element_size()
            return
        at, left = 0, r.count
        while left:  # a run larger than a chunk goes in several
            n = min(left, self.room(dtype))
            if n == 0:
                self.close()
                continue
            buf = self.take(n * buf_size(dtype), dtype)
            self.fill.append(functools.partial(buf.copy_, src[r.src_at + at : r.src_at + at + n]))
            self.items.append((self.key(r.dest), buf, r.dst_at + at))
            at, left = at + n, left - n

    def packed(self, g: Strided, src: torch.Tensor, dtype: torch.dtype) -> None:
        """``g.rows`` runs of ``g.width`` elements, ``g.step`` apart in flat local tensor ``src``
        and adjacent at the destination: packed (and converted) into pool chunks at the sender,
        so each chunk is one descriptor instead of one per row."""
        size, top = buf_size(dtype), 0
        while top < g.rows:
            rows = min(g.rows - top, self.room(dtype) // g.width)
            if rows == 0:
                if not self.items:  # a single row larger than a chunk: its own runs
                    for i in range(top, g.rows):
                        at = g.first.src_at + i * g.step
                        self.run(
                            Run(
                                g.first.source,
                                at,
                                g.first.dest,
                                g.first.dst_at + i * g.width,
                                g.width,
                            ),
                            src,
                            dtype,
                        )
                    return
                self.close()
                continue
            buf = self.take(rows * g.width * size, dtype)
            view = src[g.first.src_at + top * g.step :].as_strided((rows, g.width), (g.step, 1))
            self.fill.append(functools.partial(buf.view(rows, g.width).copy_, view))
            self.items.append((self.key(g.first.dest), buf, g.first.dst_at + top * g.width))
            top += rows

    def quant(self, b: Box, src: torch.Tensor, d: DestTensor) -> None:
        """Box ``b`` of local tensor ``src`` (its own shape) into fp8 destination ``d`` and its
        scales, in groups of whole block rows that fit a fraction of a chunk."""
        assert d.quant is not None
        view = src[tuple(slice(a, a + n) for a, n in zip(b.src_at, b.extent, strict=True))]
        if view.dim() == 1:  # a per-tensor scale of a 1-D tensor (the whole of it): one row
            view = view.view(1, -1)
        (r0, c0), (h, w) = (b.dst_at + (0,))[-2:] if len(b.dst_at) == 1 else b.dst_at, view.shape
        cols = d.shape[-1]
        block = d.quant.block
        scale_key = self.key(d.quant.scale)
        if block is None:  # one scale for the whole tensor (one rank writes all of it)
            scale = self.take(4, torch.float32)
            self.fill.append(functools.partial(_amax_scale, view, scale))
            self.items.append((scale_key, scale, 0))
            rows_per = max(1, self.chunk_bytes // 16 // max(1, w))
        else:
            rows_per = max(1, self.chunk_bytes // 16 // max(1, w * block[0])) * block[0]
        for top in range(0, h, rows_per):
            part = view[top : top + rows_per]
            ph = part.shape[0]
            if block is None:
                q = self.take(ph * w, FP8)
                self.fill.append(functools.partial(_quant_tensor, part, scale, q))
            else:
                sr, sc = math.ceil(ph / block[0]), math.ceil(w / block[1])
                q = self.take(ph * w, FP8)
                s = self.take(sr * sc * 4, torch.float32)
                self.fill.append(functools.partial(_quant_blocks, part, block, q, s))
                srow, scol, scols = (r0 + top) // block[0], c0 // block[1], scale_shape(d)[1]
                self.items += _rows(scale_key, s.view(sr, sc), srow, scol, scols)
            self.items += _rows(self.key(b.dest), q.view(ph, w), r0 + top, c0, cols)

    def done(self) -> SlotWrites:
        self.close()
        direct = make_batch(self.direct) if self.direct else None
        return SlotWrites(direct, tuple(self.chunks), self.nbytes, tuple(self.direct))


def buf_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class Strided:
    """``rows`` runs like ``first`` (``width`` elements each), ``step`` elements apart at the
    source and adjacent at the destination: a strided box of a shard into a contiguous place."""

    first: Run
    rows: int
    width: int
    step: int


#: runs of at most this many bytes, strided at the source and adjacent at the destination, are
#: packed when there are at least PACK_ROWS of them
PACK_BYTES = 64 << 10
PACK_ROWS = 8


def strided_groups(runs: Sequence[Run], size: Mapping[str, int]) -> list[Run | Strided]:
    """``runs`` with every stretch of at least PACK_ROWS short runs that are adjacent at the
    destination and evenly strided at the source as one :class:`Strided`."""
    out: list[Run | Strided] = []
    i = 0
    while i < len(runs):
        a, j = runs[i], i + 1
        if a.count * size[a.source] <= PACK_BYTES and j < len(runs):
            step = runs[j].src_at - a.src_at
            while (
                j < len(runs)
                and (b := runs[j]).source == a.source
                and b.dest == a.dest
                and b.count == a.count
                and b.src_at == a.src_at + (j - i) * step
                and b.dst_at == a.dst_at + (j - i) * a.count
            ):
                j += 1
            if j - i >= PACK_ROWS and step > a.count:
                out.append(Strided(a, j - i, a.count, step))
                i = j
                continue
        out.append(a)
        i += 1
    return out


def plan_writes(
    pool: Sequence[torch.Tensor],
    key: Callable[[str], str],
    local: Mapping[str, torch.Tensor],
    runs: Sequence[Run],
    boxes: Sequence[Box],
    dest: Mapping[str, DestTensor],
    pack: bool = True,
) -> SlotWrites:
    """The writes of one slot: ``runs`` (from the flat ``local`` tensors) and quantized
    ``boxes``; ``key(name)`` is the region of destination ``name`` in that slot. With ``pack``,
    strided stretches of short runs go packed through the pool (:func:`strided_groups`)."""
    p = WritePlanner(pool, key)
    size = {n: t.element_size() for n, t in local.items()}
    for r in strided_groups(runs, size) if pack else runs:
        if isinstance(r, Strided):
            p.packed(r, local[r.first.source].view(-1), dest[r.first.dest].dtype)
        else:
            p.run(r, local[r.source].view(-1), dest[r.dest].dtype)
    for b in boxes:
        p.quant(b, local[b.source].view(b.local), dest[b.dest])
    return p.done()


def _rows(key: str, t: torch.Tensor, row: int, col: int, cols: int) -> list[Item]:
    """Writes of 2-D ``t`` at (``row``, ``col``) of a region ``cols`` wide: one if whole rows."""
    h, w = t.shape
    if w == cols and col == 0:
        return [(key, t.reshape(-1), row * cols)]
    return [(key, t[i], (row + i) * cols + col) for i in range(h)]


def _amax_scale(x: torch.Tensor, out: torch.Tensor) -> None:
    lo, hi = torch.aminmax(x)
    amax = torch.maximum(lo.abs(), hi.abs()).float()
    out.copy_(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(1))


def _quant_tensor(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    out.view(x.shape).copy_((x.float() / scale).to(FP8))


def _quant_blocks(
    x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, s: torch.Tensor
) -> None:
    qx, sx = fp8_blockwise(x, block)
    q.view(qx.shape).copy_(qx)
    s.view(sx.shape).copy_(sx)
