"""The planning of layouts: the checks of a source and destination pair, the runs (and the
quantized boxes) each trainer rank writes, destination layouts of common shapes (full copies,
tensor-parallel shards, fp8), and the tensors a declared layout needs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from transport import LayoutError
from transport.weights.layouts import rules
from transport.weights.layouts.convert import FP8
from transport.weights.layouts.flat import flat_like
from transport.weights.layouts.rules import scale_shape
from transport.weights.layouts.types import (
    Box,
    DestTensor,
    Piece,
    Quant,
    Run,
    Slice,
    SourceLayout,
    SourceTensor,
)


def check(source: SourceLayout, dest: Mapping[str, DestTensor]) -> None:
    """Refuse (LayoutError, every problem by name) a pair of layouts that does not fit (the
    rules: weights/layouts/rules.py)."""
    found = rules.problems(source, dest, _parts)
    if found:
        raise LayoutError(found)


def plan(source: SourceLayout, dest: Mapping[str, DestTensor], rank: int) -> list[Run]:
    """The runs ``rank`` writes so that, with every other rank's runs, each destination tensor
    is whole: every destination byte written once. Checks the layouts first (LayoutError).
    Quantized destinations (fp8 with scales) are not runs: see :func:`plan_quant`."""
    return plan_all(source, dest, rank)[0]


def plan_quant(source: SourceLayout, dest: Mapping[str, DestTensor], rank: int) -> list[Box]:
    """The boxes of quantized destinations ``rank`` converts and writes (each a whole number of
    scale blocks, as :func:`check` ensures), with every other rank's: each destination element
    and scale written once."""
    return plan_all(source, dest, rank)[1]


def plan_all(
    source: SourceLayout, dest: Mapping[str, DestTensor], rank: int
) -> tuple[list[Run], list[Box]]:
    """:func:`plan` and :func:`plan_quant` at once (the layouts checked once)."""
    check(source, dest)
    runs: list[Run] = []
    boxes: list[Box] = []
    for part in _parts(source, dest, rank):
        d = dest[part.dest]
        if d.quant is None:
            runs += _runs(part, d)
        else:
            boxes.append(part)
    return _merge(runs), boxes


def _parts(source: SourceLayout, dest: Mapping[str, DestTensor], rank: int) -> list[Box]:
    """Every non-empty box ``rank`` writes, in the destination's order (the same on every rank,
    which is what deals the replicated pieces round robin)."""
    out = []
    deal = 0  # pieces of replicated sources, dealt round robin over the ranks
    for name in dest:  # the caller's order: the same on every rank
        d = dest[name]
        for p in d.pieces:
            s = source.tensors[p.source]
            if s.replicated:
                mine = deal % source.world == rank
                deal += 1
                if not mine:
                    continue
                held = Slice()
            else:
                held = s.held[rank]
            box = _box(p, s, held, name, d)
            if box is not None:
                out.append(box)
    return out


def _box(p: Piece, s: SourceTensor, held: Slice, name: str, d: DestTensor) -> Box | None:
    have, want = held.box(s.shape), p.take.box(s.shape)
    box = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(have, want, strict=True)]
    if any(hi <= lo for lo, hi in box):
        return None
    return Box(
        p.source,
        tuple(hi - lo for lo, hi in have),
        tuple(lo - h0 for (lo, _), (h0, _) in zip(box, have, strict=True)),
        name,
        tuple(
            lo - w0 + (p.at if k == d.dim else 0)
            for k, ((lo, _), (w0, _)) in enumerate(zip(box, want, strict=True))
        ),
        tuple(hi - lo for lo, hi in box),
    )


def _runs(b: Box, d: DestTensor) -> list[Run]:
    extent, local = list(b.extent), list(b.local)
    # the innermost dims both layouts hold whole are one contiguous run per index of the others
    k = len(extent)
    while k > 0 and extent[k - 1] == local[k - 1] == d.shape[k - 1]:
        k -= 1
    if k > 0:
        k -= 1  # dim k is partial: it runs too, but in one piece per index of the dims before
    length = math.prod(extent[k:])
    src_stride, dst_stride = _strides(local), _strides(d.shape)
    grids = np.meshgrid(*[np.arange(n) for n in extent[:k]], indexing="ij") if k else []
    src0 = sum(a * st for a, st in zip(b.src_at, src_stride, strict=True))
    dst0 = sum(a * st for a, st in zip(b.dst_at, dst_stride, strict=True))
    if k:
        src_off = src0 + sum(g * src_stride[i] for i, g in enumerate(grids)).ravel()
        dst_off = dst0 + sum(g * dst_stride[i] for i, g in enumerate(grids)).ravel()
    else:
        src_off, dst_off = np.array([src0]), np.array([dst0])
    return [
        Run(b.source, int(a), b.dest, int(c), length)
        for a, c in zip(src_off.tolist(), dst_off.tolist(), strict=True)
    ]


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _merge(runs: list[Run]) -> list[Run]:
    """Runs adjacent at both ends (same tensors) become one."""
    out: list[Run] = []
    for r in runs:
        last = out[-1] if out else None
        if (
            last is not None
            and last.source == r.source
            and last.dest == r.dest
            and last.src_at + last.count == r.src_at
            and last.dst_at + last.count == r.dst_at
        ):
            out[-1] = Run(r.source, last.src_at, r.dest, last.dst_at, last.count + r.count)
        else:
            out.append(r)
    return out


def apply_runs(
    runs: Sequence[Run], local: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor]
) -> None:
    """Copy ``runs`` from this rank's local tensors into destination tensors in this process,
    converting dtypes as ``copy_`` does (the reference the tests compare against, and what a
    local destination does)."""
    for r in runs:
        src = local[r.source].view(-1)[r.src_at : r.src_at + r.count]
        dest[r.dest].view(-1)[r.dst_at : r.dst_at + r.count].copy_(src)


def check_dest(
    layout: Mapping[str, DestTensor], tensors: Mapping[str, torch.Tensor]
) -> dict[str, DestTensor]:
    """A subscriber's declared ``layout`` against its own ``tensors`` (the same names, shapes
    and dtypes), or LayoutError with every mismatch."""
    problems = []
    if not isinstance(layout, Mapping) or not all(
        isinstance(d, DestTensor) for d in layout.values()
    ):
        raise TypeError("layout must be a dict of destination name -> DestTensor")
    for name in sorted(set(layout) | set(tensors)):
        d, t = layout.get(name), tensors.get(name)
        if d is None:
            problems.append(f"tensor {name!r} has no entry in the layout")
        elif t is None:
            problems.append(f"the layout names {name!r}, which is not one of the tensors")
        elif tuple(t.shape) != tuple(d.shape) or t.dtype != d.dtype:
            problems.append(
                f"tensor {name!r} is {tuple(t.shape)} {t.dtype}, its layout says "
                f"{tuple(d.shape)} {d.dtype}"
            )
    if problems:
        raise LayoutError(problems)
    return dict(layout)


def full_copy(
    source: SourceLayout,
    names: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> dict[str, DestTensor]:
    """A destination of whole tensors (``rename``: destination name -> source name)."""
    pairs = [(n, n) for n in (names or list(source.tensors))] + list((rename or {}).items())
    return {
        dst: DestTensor(source.tensors[src].shape, source.tensors[src].dtype, (Piece(src),))
        for dst, src in pairs
    }


def tp_shard(
    source: SourceLayout, dest_name: str, parts: Sequence[str], dim: int, degree: int, rank: int
) -> DestTensor:
    """Tensor-parallel rank ``rank`` of ``degree``'s share of ``dest_name``: the ``rank``-th
    equal chunk along ``dim`` of each source of ``parts``, stacked along ``dim`` in that order
    (vLLM's column-parallel fused parameters: ``qkv_proj`` from q, k, v; ``gate_up_proj`` from
    gate, up; one part: a plain column (dim 0) or row (dim 1) shard)."""
    pieces, at, shape = [], 0, None
    for src in parts:
        s = source.tensors[src]
        n = s.shape[dim]
        if n % degree:
            raise LayoutError([f"{src!r}: {n} along dim {dim} does not split into {degree}"])
        step = n // degree
        pieces.append(Piece(src, Slice(dim, rank * step, (rank + 1) * step), at))
        at += step
        shape = list(s.shape)
    assert shape is not None, f"{dest_name!r} has no parts"
    shape[dim] = at
    return DestTensor(tuple(shape), source.tensors[parts[0]].dtype, tuple(pieces), dim)


def fp8(
    layout: Mapping[str, DestTensor],
    names: Sequence[str] | None = None,
    block: tuple[int, int] | None = (128, 128),
    suffix: str = "_scale",
) -> dict[str, DestTensor]:
    """``layout`` with ``names`` (default: every 2-D tensor) in fp8 e4m3, each with a float32
    scales tensor ``<name><suffix>`` (per ``block``, or per tensor with ``block=None``)."""
    out = dict(layout)
    for name in names if names is not None else [n for n, d in layout.items() if len(d.shape) == 2]:
        d = layout[name]
        q = DestTensor(d.shape, FP8, d.pieces, d.dim, Quant(name + suffix, block))
        out[name] = q
        out[name + suffix] = DestTensor(scale_shape(q), torch.float32, (), 0, None, name)
    return out


def tensors_for(
    layout: Mapping[str, DestTensor], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Zeroed tensors of a destination layout's shapes and dtypes, in one flat buffer per
    device (a subscriber's live tensors when the engine has none of its own)."""
    meta = {n: torch.empty(d.shape, dtype=d.dtype, device="meta") for n, d in layout.items()}
    out = flat_like(meta, device)
    for t in out.values():
        t.zero_()
    return out


def check_shards(
    shards: Mapping[str, torch.Tensor], layout: SourceLayout, rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shards checked against ``layout`` (every name, its local shape and dtype;
    LayoutError lists every mismatch), flat."""
    problems = []
    for name in sorted(set(shards) | set(layout.tensors)):
        t, s = shards.get(name), layout.tensors.get(name)
        if s is None:
            problems.append(f"shard {name!r} is not in the source layout")
        elif t is None:
            problems.append(f"rank {rank} has no shard of {name!r}")
        elif not isinstance(t, torch.Tensor) or not t.is_contiguous():
            problems.append(f"shard {name!r} must be a contiguous tensor")
        elif tuple(t.shape) != layout.local_shape(rank, name) or t.dtype != s.dtype:
            problems.append(
                f"shard {name!r} is {tuple(t.shape)} {t.dtype}; the layout says rank {rank} holds "
                f"{layout.local_shape(rank, name)} {s.dtype}"
            )
    if problems:
        raise LayoutError(problems)
    return {n: t.reshape(-1) for n, t in shards.items()}
