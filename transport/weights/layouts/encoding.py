"""Layouts on the wire: a subscriber's declared destination layout as the store holds it, and the
digest by which the ranks of a sharded trainer check that they share one source layout.

A destination layout is a msgpack map ``{"v": 1, "t": {name: [shape, dtype, dim, pieces, quant,
scale_of]}, "s": {source: shape}}`` ("s", the source shapes the subscriber expects, optional),
each piece ``[source, take_dim or None, start, stop, at]``, ``quant`` None or
``[scale name, [block rows, block cols] or None]``. :func:`decode_dest` reads a peer's
bytes: exact forms, sizes and ranges (every index within the destination's own dims), or
:class:`WireFormatError`; what fits is then checked against the source layout by
``layouts.check`` like any other, which refuses (LayoutError) any index out of range rather
than fail on it. Either way a subscriber whose layout does not fit is left out of every publish,
with the rule it broke, and the others are served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack
import torch

from transport import WireFormatError
from transport.contract import dtype_name, is_count, unpack
from transport.weights.layouts.planning import DestTensor, Piece, Quant, Slice, SourceLayout

#: the most destination tensors and pieces one subscriber may declare
MAX_TENSORS = 1 << 18
MAX_PIECES = 4096  # a fused experts tensor from one tensor per expert matrix: 2 per expert
MAX_DIMS = 8
DTYPES = {
    dtype_name(d): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def encode_dest(
    layout: Mapping[str, DestTensor], sources: Mapping[str, tuple[int, ...]] | None = None
) -> bytes:
    """``layout`` as the store holds it; ``sources``: the global shape the subscriber expects
    of each source tensor its pieces name (a publisher whose source has another shape is a
    trainer of another model, and is refused before a byte moves)."""
    out = {
        name: [
            list(d.shape),
            dtype_name(d.dtype),
            d.dim,
            [[p.source, p.take.dim, p.take.start, p.take.stop, p.at] for p in d.pieces],
            None
            if d.quant is None
            else [d.quant.scale, None if d.quant.block is None else list(d.quant.block)],
            d.scale_of,
        ]
        for name, d in layout.items()
    }
    m: dict[str, Any] = {"v": 1, "t": out}
    if sources:
        m["s"] = {n: list(shape) for n, shape in sources.items()}
    packed: bytes = msgpack.packb(m, use_bin_type=True)
    return packed


def decode_sources(raw: bytes, limit: int = 64 << 20) -> dict[str, tuple[int, ...]]:
    """The source shapes a declared layout expects (empty when it states none), or
    WireFormatError naming the broken rule."""
    m = unpack(
        raw, "destination layout", limit, max_str=1024, max_array=MAX_TENSORS, max_map=MAX_TENSORS
    )
    given = m.get("s", {}) if isinstance(m, dict) else None
    if not isinstance(given, dict) or len(given) > MAX_TENSORS:
        raise WireFormatError("a layout's source shapes are {name: [sizes]}")
    out = {}
    for name, shape in given.items():
        if (
            not isinstance(shape, list)
            or not 0 < len(shape) <= MAX_DIMS
            or not all(is_count(n) for n in shape)
        ):
            raise WireFormatError(f"source {str(name)[:80]!r}: malformed shape")
        out[_name(name)] = tuple(shape)
    return out


def decode_dest(raw: bytes, limit: int = 64 << 20) -> dict[str, DestTensor]:
    """A peer's declared destination layout, or WireFormatError naming the broken rule."""
    m = unpack(
        raw, "destination layout", limit, max_str=1024, max_array=MAX_TENSORS, max_map=MAX_TENSORS
    )
    if not isinstance(m, dict) or not {"v", "t"} <= set(m) <= {"v", "t", "s"} or m["v"] != 1:
        raise WireFormatError("a destination layout is {'v': 1, 't': {name: ...}, 's': ...}")
    tensors = m["t"]
    if not isinstance(tensors, dict) or not tensors:
        raise WireFormatError("a destination layout names at least one tensor")
    return {_name(n): _dest(n, e) for n, e in tensors.items()}


def _dest(name: str, e: Any) -> DestTensor:
    if not isinstance(e, list) or len(e) != 6:
        raise WireFormatError(
            f"destination {name!r}: expected [shape, dtype, dim, pieces, quant, scale_of]"
        )
    shape, dtype, dim, pieces, quant, scale_of = e
    if (
        not isinstance(shape, list)
        or not 0 < len(shape) <= MAX_DIMS
        or not all(is_count(n) for n in shape)
        or not isinstance(dtype, str)
        or dtype not in DTYPES
        or not is_count(dim)
        or dim >= len(shape)
        or not isinstance(pieces, list)
        or not len(pieces) <= MAX_PIECES
        or not isinstance(scale_of, str)
    ):
        raise WireFormatError(f"destination {name!r}: malformed shape, dtype, dim or pieces")
    out = []
    for p in pieces:
        if (
            not isinstance(p, list)
            or len(p) != 5
            or not isinstance(p[0], str)
            or not (p[1] is None or (is_count(p[1]) and p[1] < MAX_DIMS))
            or not all(is_count(x) for x in p[2:])
        ):
            raise WireFormatError(f"destination {name!r}: malformed piece {str(p)[:80]}")
        if p[1] is not None and (p[1] >= len(shape) or p[2] > p[3]):
            # a piece's source has the destination's dims (checked against the source later)
            raise WireFormatError(
                f"destination {name!r}: a piece takes {p[2]}..{p[3]} of dim {p[1]}; it must be a "
                f"span (start <= stop) of one of the destination's {len(shape)} dims"
            )
        take = Slice() if p[1] is None else Slice(p[1], p[2], p[3])
        out.append(Piece(_name(p[0]), take, p[4]))
    return DestTensor(
        tuple(shape),
        DTYPES[dtype],
        tuple(out),
        dim,
        _quant(name, quant),
        _name(scale_of) if scale_of else "",
    )


def _quant(name: str, q: Any) -> Quant | None:
    if q is None:
        return None
    if (
        not isinstance(q, list)
        or len(q) != 2
        or not (
            q[1] is None
            or (isinstance(q[1], list) and len(q[1]) == 2 and all(is_count(x) and x for x in q[1]))
        )
    ):
        raise WireFormatError(f"destination {name!r}: quant is [scale name, [rows, cols] or None]")
    return Quant(_name(q[0]), None if q[1] is None else (q[1][0], q[1][1]))


def source_digest(layout: SourceLayout) -> str:
    """A short digest of a source layout: the ranks of one trainer must all compute the same."""
    rows = [
        [
            name,
            list(t.shape),
            dtype_name(t.dtype),
            sorted([r, s.dim, s.start, s.stop] for r, s in t.held.items()),
        ]
        for name, t in sorted(layout.tensors.items())
    ]
    packed = msgpack.packb([layout.world, rows])
    return hashlib.sha256(packed).hexdigest()[:32]


def _name(x: Any) -> str:
    if not isinstance(x, str) or not x or len(x) > 512 or "\x00" in x:
        raise WireFormatError(f"a tensor name must be a short str, got {str(x)[:80]}")
    return x
