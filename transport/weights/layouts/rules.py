"""The rules a source layout and a destination layout must follow to fit (``layouts.check``):
every problem by name, never an exception. A destination layout is what a subscriber declared
(``wire`` reads it from the store), so every index in it is checked before it is used."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from transport.weights.layouts.convert import FLOATS, FP8
from transport.weights.layouts.types import Box, DestTensor, SourceLayout, SourceTensor

#: ``layouts._parts`` (planning is ``layouts``' job, passed in): the boxes one rank writes of some
#: destinations
Parts = Callable[[SourceLayout, Mapping[str, DestTensor], int], Sequence[Box]]


def problems(source: SourceLayout, dest: Mapping[str, DestTensor], parts: Parts) -> list[str]:
    """Every way ``dest`` does not fit ``source`` (empty: it fits)."""
    out: list[str] = []
    for name, t in sorted(source.tensors.items()):
        out += _check_source(name, t, source.world)
    for name, d in sorted(dest.items()):
        if d.scale_of:
            out += _check_scale(name, d, dest)
            continue
        mine = _check_dest(name, d, source)
        if d.quant is not None and not mine:
            mine = _check_quant(name, d, source, dest, parts)
        out += mine
    return out


def scale_shape(d: DestTensor) -> tuple[int, ...]:
    """The shape of the scales of quantized destination ``d``."""
    assert d.quant is not None
    if d.quant.block is None:
        return (1,)
    (br, bc), (rows, cols) = d.quant.block, d.shape
    return (math.ceil(rows / br), math.ceil(cols / bc))


def convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether the sender converts ``src`` to ``dst`` in flight (floating point to floating
    point; fp8 destinations come with a scale, see transport/weights/layouts/convert.py)."""
    return src in FLOATS and dst in FLOATS


def _check_scale(name: str, d: DestTensor, dest: Mapping[str, DestTensor]) -> list[str]:
    owner = dest.get(d.scale_of)
    if owner is None or owner.quant is None or owner.quant.scale != name:
        return [f"scales {name!r} belong to {d.scale_of!r}, which does not name them as its scale"]
    block = owner.quant.block
    if block is not None and (
        len(owner.shape) != 2 or len(block) != 2 or not all(_positive(n) for n in block)
    ):
        return [
            f"scales {name!r}: block scales are for 2-D tensors and blocks of two positive ints; "
            f"{d.scale_of!r} is {tuple(owner.shape)} in blocks of {block!r}"
        ]
    if d.dtype != torch.float32 or tuple(d.shape) != scale_shape(owner) or d.pieces:
        return [
            f"scales {name!r} of {d.scale_of!r} must be float32 {scale_shape(owner)} without "
            f"pieces, got {d.dtype} {tuple(d.shape)}"
        ]
    return []


def _check_quant(
    name: str, d: DestTensor, source: SourceLayout, dest: Mapping[str, DestTensor], parts: Parts
) -> list[str]:
    """A quantized destination: fp8 of a float source, its scales declared, and every scale
    block inside what one rank writes (a block's amax is computed by one rank, no exchange)."""
    q = d.quant
    assert q is not None
    if d.dtype != FP8 or any(source.tensors[p.source].dtype not in FLOATS for p in d.pieces):
        return [f"destination {name!r}: quantized destinations are {FP8} of float sources"]
    if q.scale not in dest or dest[q.scale].scale_of != name:
        return [
            f"destination {name!r}: its scales {q.scale!r} are not declared (scale_of={name!r})"
        ]
    if q.block is not None and (
        len(d.shape) != 2 or len(q.block) != 2 or not all(_positive(n) for n in q.block)
    ):
        return [f"destination {name!r}: block scales are for 2-D tensors and positive blocks"]
    if len(d.shape) > 2:
        return [f"destination {name!r}: fp8 destinations are 1-D or 2-D"]
    boxes = [(r, b) for r in range(source.world) for b in parts(source, {name: d}, r)]
    if q.block is None:
        if len(boxes) != 1:
            return [
                f"destination {name!r}: a per-tensor fp8 scale needs the whole tensor from one "
                f"rank, it comes in {len(boxes)} parts; use block scales (Quant(block=(128, 128)))"
            ]
        return []
    problems = []
    for r, b in boxes:
        for k in (0, 1):
            lo, hi, step = b.dst_at[k], b.dst_at[k] + b.extent[k], q.block[k]
            if lo % step or (hi % step and hi != d.shape[k]):
                problems.append(
                    f"destination {name!r}: rank {r}'s part of {b.source!r} spans {lo}..{hi} of "
                    f"dim {k}, across fp8 blocks of {step} (each block must come from one rank: "
                    "shard on block multiples, or use other blocks)"
                )
                break
    return problems[:1]


def _check_source(name: str, t: SourceTensor, world: int) -> list[str]:
    if sorted(t.held) != list(range(world)):
        return [f"source {name!r}: held by ranks {sorted(t.held)}, expected 0..{world - 1}"]
    if t.replicated:
        return []
    dims = {s.dim for s in t.held.values()}
    if len(dims) != 1 or None in dims:
        return [f"source {name!r}: shards must all split one dim (or all be whole), got {dims}"]
    (dim,) = dims
    assert dim is not None
    if not 0 <= dim < len(t.shape):
        return [f"source {name!r}: shard dim {dim} outside its {len(t.shape)} dims"]
    spans = sorted((s.start, s.stop) for s in t.held.values())
    at = 0
    for lo, hi in spans:
        if lo < at:
            return [f"source {name!r}: shards overlap at {lo} of dim {dim}"]
        if lo > at:
            return [f"source {name!r}: rows {at}..{lo} of dim {dim} are held by no rank"]
        at = max(at, hi)
    if at != t.shape[dim]:
        return [f"source {name!r}: shards cover {at} of {t.shape[dim]} along dim {dim}"]
    return []


def _check_dest(name: str, d: DestTensor, source: SourceLayout) -> list[str]:
    """Whether destination ``name`` is made whole of its pieces. Every index a peer declared is
    checked before it is used: a layout is what a subscriber says (``wire``)."""
    problems = []
    covered: list[tuple[int, int]] = []
    if not d.pieces:
        return [f"destination {name!r} has no pieces (only scales, with scale_of=, have none)"]
    if not _index(d.dim, len(d.shape)):
        return [
            f"destination {name!r}: its stacking dim {d.dim!r} is not one of its "
            f"{len(d.shape)} dims"
        ]
    for p in d.pieces:
        s = source.tensors.get(p.source)
        if s is None:
            problems.append(f"destination {name!r}: source {p.source!r} does not exist")
            continue
        if s.dtype != d.dtype and not convertible(s.dtype, d.dtype) and d.quant is None:
            problems.append(
                f"destination {name!r} is {d.dtype}, its source {p.source!r} is {s.dtype}: "
                "only floating-point dtypes convert in flight"
            )
        if len(s.shape) != len(d.shape):
            problems.append(
                f"destination {name!r} has {len(d.shape)} dims, its source {p.source!r} "
                f"{len(s.shape)}"
            )
            continue
        if p.take.dim is not None and not _index(p.take.dim, len(s.shape)):
            problems.append(
                f"destination {name!r}: a piece of {p.source!r} takes dim {p.take.dim!r}, which "
                f"is not one of its {len(s.shape)} dims"
            )
            continue
        box = p.take.box(s.shape)
        if p.take.dim is not None and not 0 <= p.take.start <= p.take.stop <= s.shape[p.take.dim]:
            problems.append(
                f"destination {name!r}: piece {p.take.start}..{p.take.stop} of {p.source!r} "
                f"is outside its dim {p.take.dim} of {s.shape[p.take.dim]}"
            )
            continue
        extent = [hi - lo for lo, hi in box]
        other = [n for k, n in enumerate(extent) if k != d.dim]
        want = [n for k, n in enumerate(d.shape) if k != d.dim]
        if other != want:
            problems.append(
                f"destination {name!r} {tuple(d.shape)}: piece of {p.source!r} is "
                f"{tuple(extent)} (dims other than {d.dim} must agree)"
            )
            continue
        covered.append((p.at, p.at + extent[d.dim]))
    at = 0
    for lo, hi in sorted(covered):
        if lo < at:
            problems.append(f"destination {name!r}: pieces overlap at {lo} of dim {d.dim}")
        elif lo > at:
            problems.append(f"destination {name!r}: {at}..{lo} of dim {d.dim} is not covered")
        at = max(at, hi)
    if not problems and at != d.shape[d.dim]:
        problems.append(
            f"destination {name!r}: pieces cover {at} of {d.shape[d.dim]} along dim {d.dim}"
        )
    return problems


def _index(k: object, n: int) -> bool:
    """Whether ``k`` is an index of ``n`` dims (an int, not a bool, from 0 to ``n - 1``)."""
    return isinstance(k, int) and not isinstance(k, bool) and 0 <= k < n


def _positive(k: object) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and k > 0
