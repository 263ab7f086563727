"""A version's changes against its base as one blob, and the blob applied onto the base, bit for bit.

What both sides agree on is a :class:`DeltaLayout`: tensors in one order, each seen as elements
of its width (1, 2, 4 or 8 bytes; wider ones as 8-byte halves), compared and written as integers
so that every bit counts (a NaN is a value like any other, -0.0 is not 0.0). The tensors of one
width form one virtual array, cut into chunks of :data:`CHUNK` elements (a chunk may span two
tensors). Each chunk travels in whichever of three encodings is smallest for its density:

- ``SPARSE``: the changed elements' offsets in the chunk (2 bytes each) and their values;
- ``MASK``: a bitmask of the chunk (one bit per element) and the changed values;
- ``WHOLE``: every value of the chunk;

and an unchanged chunk not at all. Values are the new bits, in the chunk's order.

The blob (little-endian, every section padded to 8 bytes)::

    header   magic "TDLT", format, groups, layout digest, version, base        (32 bytes)
    per width group, in the layout's order:
      head   width, chunks listed, offsets, values                             (24 bytes)
      ids    int32 per listed chunk (strictly increasing)
      kinds  uint8 per listed chunk
      counts int32 per listed chunk (values it carries)
      offsets  uint16 per changed element of the SPARSE chunks
      masks    CHUNK / 8 bytes per MASK chunk
      values   width bytes per value

This module makes blobs (:func:`encode`, :class:`ChangeSet`); decoder.py checks a peer's blob
rule by rule and applies it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

#: elements per chunk: an offset inside one fits 16 bits
CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
#: elements the encoder compares at once, a multiple of CHUNK (bounds its scratch memory)
BATCH = 64 * CHUNK

SKIP, SPARSE, MASK, WHOLE = 0, 1, 2, 3

MAGIC = b"TDLT"
FORMAT = 1
HEAD = struct.Struct("<4sHHQqq")
GROUP_HEAD = struct.Struct("<IIQQ")
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: packing 8 bools (one byte each, 0 or 1) read as a little-endian int64: the product's top byte
#: holds bool j at bit j (every other partial product lands above bit 63 or below bit 56, each on
#: a bit of its own, so nothing carries into the top byte)
_PACK = 0x0102040810204080


def _pack_bits(rows: torch.Tensor) -> torch.Tensor:
    """Bool rows of CHUNK elements as bitmasks: CHUNK / 8 bytes each, element j of every 8 at
    bit j (the blob's MASK section)."""
    words = rows.contiguous().view(torch.uint8).view(torch.int64)
    return (((words * _PACK) >> 56) & 0xFF).to(torch.uint8).view(-1, CHUNK // 8)


def width_of(t: torch.Tensor) -> int:
    """The element width a tensor is compared in: its item size, 8 for wider ones."""
    return min(t.element_size(), 8)


def as_ints(t: torch.Tensor, width: int) -> torch.Tensor:
    """A contiguous tensor's bits as a flat tensor of ``width``-byte integers (a view)."""
    return t.reshape(-1).view(torch.uint8).view(INTS[width])


@dataclass(frozen=True)
class Span:
    """One tensor's place in its width group's virtual array: elements ``start`` to
    ``start + count - 1``."""

    name: str
    start: int
    count: int


@dataclass(frozen=True)
class Group:
    """The tensors of one element width, one after the other: ``total`` elements."""

    width: int
    spans: tuple[Span, ...]
    total: int

    @property
    def chunks(self) -> int:
        return -(-self.total // CHUNK)

    def chunk_len(self, chunk: int) -> int:
        return min(CHUNK, self.total - chunk * CHUNK)


class DeltaLayout:
    """The tensors a delta covers, in the order given (both sides give the same order), grouped
    by element width; ``digest`` names the names, shapes and dtypes, so that a blob made for
    other tensors is refused. Tensors without elements take no place."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        spans: dict[int, list[Span]] = {}
        ends: dict[int, int] = {}
        h = hashlib.blake2b(digest_size=8)
        for name, t in named.items():
            h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
            n = t.numel() * t.element_size()
            if n == 0:
                continue
            w = width_of(t)
            at = ends.get(w, 0)
            spans.setdefault(w, []).append(Span(name, at, n // w))
            ends[w] = at + n // w
        self.groups = tuple(Group(w, tuple(spans[w]), ends[w]) for w in sorted(spans))
        self.digest = int.from_bytes(h.digest(), "little")
        #: bytes of every tensor: what the version costs whole
        self.nbytes = sum(g.total * g.width for g in self.groups)


@dataclass
class Encoded:
    """A version's changes against ``base``: ``blob`` (uint8, where the tensors are) to apply
    onto exactly that version; ``changed`` of ``elements`` elements differ."""

    version: int
    base: int
    blob: torch.Tensor
    changed: int
    elements: int


def padded(n: int) -> int:
    """``n`` bytes rounded up to the blob's 8-byte alignment."""
    return -(-n // 8) * 8


def _pieces(group: Group, a: int, b: int) -> Iterator[tuple[Span, int, int]]:
    """The parts of the tensors of ``group`` in virtual elements ``a`` to ``b - 1``: (span,
    first, end) in the span's own elements."""
    for span in group.spans:
        lo, hi = max(a, span.start), min(b, span.start + span.count)
        if lo < hi:
            yield span, lo - span.start, hi - span.start
        elif span.start >= b:
            break


def _kinds(
    counts: torch.Tensor, lens: torch.Tensor, width: int, partial: bool = False
) -> torch.Tensor:
    """The smallest encoding of each chunk for its count of changes (SKIP when none);
    ``partial``: the unchanged values are not known, so WHOLE only where every element changed."""
    sparse = counts * (2 + width)
    mask = (lens + 7) // 8 + counts * width
    whole = lens * width
    kinds = torch.full_like(counts, SPARSE)
    kinds[mask < sparse] = MASK
    whole_ok = whole <= torch.minimum(sparse, mask)
    kinds[whole_ok & (counts == lens) if partial else whole_ok] = WHOLE
    kinds[counts == 0] = SKIP
    return kinds


class _GroupParts:
    """What the encoder found in one width group, section by section."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.ids: list[torch.Tensor] = []
        self.kinds: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.offsets: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.nbytes = GROUP_HEAD.size

    def add(self, **sections: torch.Tensor) -> None:
        for key, t in sections.items():
            getattr(self, key).append(t)
            self.nbytes += t.numel() * t.element_size()

    def cat(self, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        parts = getattr(self, key)
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def encode(
    layout: DeltaLayout,
    current: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    version: int,
    base_version: int,
    limit: int | None = None,
) -> Encoded | None:
    """``current``'s changes against ``base`` (both named as in ``layout``, contiguous, on one
    device), and ``base`` made equal to ``current`` (it is the next version's base).

    None when the blob would exceed ``limit`` bytes: ``base`` is made equal to ``current`` all
    the same (the version then travels whole)."""
    device = next(iter(current.values())).device if current else torch.device("cpu")
    parts: list[_GroupParts] = []
    changed = 0
    over = False
    for group in layout.groups:
        gp = _GroupParts(group.width)
        parts.append(gp)
        cur = {s.name: as_ints(current[s.name], group.width) for s in group.spans}
        old = {s.name: as_ints(base[s.name], group.width) for s in group.spans}
        for a in range(0, group.total, BATCH):
            b = min(a + BATCH, group.total)
            pieces = list(_pieces(group, a, b))
            if over:  # past the limit: only the base is brought up to date
                for span, lo, hi in pieces:
                    old[span.name][lo:hi].copy_(cur[span.name][lo:hi])
                continue
            changed += _encode_batch(group, a, b, pieces, cur, old, gp, device)
            if limit is not None and HEAD.size + sum(p.nbytes for p in parts) > limit:
                over = True
    if over:
        return None
    blob = _assemble(layout, parts, version, base_version, device)
    elements = sum(g.total for g in layout.groups)
    return Encoded(version, base_version, blob, changed, elements)


def _encode_batch(
    group: Group,
    a: int,
    b: int,
    pieces: list[tuple[Span, int, int]],
    cur: Mapping[str, torch.Tensor],
    old: Mapping[str, torch.Tensor],
    gp: _GroupParts,
    device: torch.device,
) -> int:
    """Encode virtual elements ``a`` to ``b - 1`` of ``group`` (``a`` a multiple of CHUNK) and
    bring the base up to date there; returns how many elements changed."""
    nchunks = -(-(b - a) // CHUNK)
    mask = torch.zeros(nchunks * CHUNK, dtype=torch.bool, device=device)
    for span, lo, hi in pieces:
        at = span.start + lo - a
        torch.ne(cur[span.name][lo:hi], old[span.name][lo:hi], out=mask[at : at + hi - lo])
    grid = mask.view(nchunks, CHUNK)
    counts = grid.view(torch.uint8).sum(1, dtype=torch.int32)  # a bool sum is 8x slower
    lens = torch.full((nchunks,), CHUNK, dtype=torch.int32, device=device)
    lens[-1] = b - a - (nchunks - 1) * CHUNK
    kinds = _kinds(counts, lens, group.width)
    listed = torch.nonzero(kinds != SKIP).flatten()
    if listed.numel() == 0:
        return 0
    changed = int(counts.sum())
    whole = kinds == WHOLE
    if bool(whole.any()):
        grid[whole] = True
        mask[b - a :] = False  # the last chunk's padding is no element
        counts = torch.where(whole, lens, counts)
    # one pass finds every value's position (from ``a``), in order; the rest works on those
    where = torch.nonzero(mask).flatten()
    sparse = kinds[where >> CHUNK_BITS] == SPARSE
    offsets = (where[sparse] & (CHUNK - 1)).to(torch.int32).to(torch.int16)
    mask_rows = grid[kinds == MASK]
    packed = _pack_bits(mask_rows)
    values = []
    ends = [span.start + hi - a for span, _, hi in pieces]
    cuts = torch.searchsorted(where, torch.tensor(ends, device=device)).tolist()
    first = 0
    for (span, lo, _), cut in zip(pieces, cuts, strict=True):
        at = span.start + lo - a
        idx = where[first:cut] - at
        first = cut
        v = cur[span.name][lo:].index_select(0, idx)
        old[span.name][lo:].index_copy_(0, idx, v)  # the base becomes this version
        values.append(v)
    gp.add(
        ids=(listed + a // CHUNK).to(torch.int32),
        kinds=kinds[listed].to(torch.uint8),
        counts=counts[listed].to(torch.int32),
        offsets=offsets,
        masks=packed.reshape(-1),
        values=torch.cat(values),
    )
    return changed


class ChangeSet:
    """Changes gathered piece by piece, where the encoder does not see whole tensors: a rank of
    a sharded trainer compares only the parts of a subscriber's tensors it writes (converted as
    they are written) with its copy of them. It owns what it found per width group: positions
    in the group's virtual array and the new values. Rules: pieces never overlap; each is
    compared once per version; :meth:`encode` sorts them and packs the same blob
    :func:`encode` makes, which :func:`decode` checks and :func:`apply` writes as any other."""

    def __init__(self, layout: DeltaLayout) -> None:
        self.layout = layout
        self._where = {s.name: (g, s) for g in layout.groups for s in g.spans}
        self._found: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.changed = 0

    def compare(self, name: str, offset: int, current: torch.Tensor, base: torch.Tensor) -> None:
        """Elements ``offset`` on (in the tensor's own elements) of tensor ``name``: ``current``
        against ``base`` (contiguous, its dtype), which is brought up to date."""
        if not current.numel():
            return
        group, span = self._where[name]
        w = group.width
        cur, old = as_ints(current, w), as_ints(base, w)
        at = span.start + offset * (current.element_size() // w)
        if at < span.start or at + cur.numel() > span.start + span.count:
            raise ValueError(f"delta: a piece of {name!r} past its end")
        idx = torch.nonzero(cur != old).flatten()
        if idx.numel():
            values = cur[idx]
            old[idx] = values
            self._found.setdefault(w, []).append((idx + at, values))
            self.changed += idx.numel()

    def encode(self, version: int, base_version: int, limit: int | None = None) -> Encoded | None:
        """The blob of everything compared (None: it would exceed ``limit`` bytes)."""
        found = next(iter(self._found.values()), [])
        device = found[0][0].device if found else torch.device("cpu")
        parts: list[_GroupParts] = []
        for group in self.layout.groups:
            gp = _GroupParts(group.width)
            parts.append(gp)
            pieces = self._found.get(group.width, [])
            if not pieces:
                continue
            pos = torch.cat([p for p, _ in pieces])
            vals = torch.cat([v for _, v in pieces])
            pos, order = torch.sort(pos)
            _pack(group, pos, vals[order], gp, device)
            if limit is not None and HEAD.size + sum(p.nbytes for p in parts) > limit:
                return None
        blob = _assemble(self.layout, parts, version, base_version, device)
        elements = sum(g.total for g in self.layout.groups)
        return Encoded(version, base_version, blob, self.changed, elements)


def _pack(
    group: Group, pos: torch.Tensor, vals: torch.Tensor, gp: _GroupParts, device: torch.device
) -> None:
    """Sorted positions and their values of ``group`` as its sections, BATCH elements at a time
    (bounds the masks' scratch memory)."""
    ids = pos // CHUNK
    chunks, counts = torch.unique_consecutive(ids, return_counts=True)
    per_batch = BATCH // CHUNK
    first = torch.cumsum(counts, 0) - counts  # where each chunk's elements start
    for a in range(0, chunks.numel(), per_batch):
        cid, cnt = chunks[a : a + per_batch], counts[a : a + per_batch]
        lo = int(first[a])
        hi = lo + int(cnt.sum())
        lens = torch.clamp(group.total - cid * CHUNK, max=CHUNK)
        kinds = _kinds(cnt, lens, group.width, partial=True)
        per = torch.repeat_interleave(kinds, cnt)
        offs = pos[lo:hi] % CHUNK
        rows = torch.cumsum((kinds == MASK).to(torch.int64), 0) - 1
        nmask = int((kinds == MASK).sum())
        grid = torch.zeros(nmask, CHUNK, dtype=torch.bool, device=device)
        is_mask = per == MASK
        grid[torch.repeat_interleave(rows, cnt)[is_mask], offs[is_mask]] = True
        packed = _pack_bits(grid)
        gp.add(
            ids=cid.to(torch.int32),
            kinds=kinds.to(torch.uint8),
            counts=cnt.to(torch.int32),
            offsets=offs[per == SPARSE].to(torch.int32).to(torch.int16),
            masks=packed.reshape(-1),
            values=vals[lo:hi],
        )


def _assemble(
    layout: DeltaLayout,
    parts: list[_GroupParts],
    version: int,
    base_version: int,
    device: torch.device,
) -> torch.Tensor:
    out: list[torch.Tensor] = [
        _bytes(HEAD.pack(MAGIC, FORMAT, len(parts), layout.digest, version, base_version), device)
    ]
    for gp in parts:
        ids = gp.cat("ids", torch.int32, device)
        offsets = gp.cat("offsets", torch.int16, device)
        values = gp.cat("values", INTS[gp.width], device)
        head = GROUP_HEAD.pack(gp.width, ids.numel(), offsets.numel(), values.numel())
        out.append(_bytes(head, device))
        for section in (
            ids,
            gp.cat("kinds", torch.uint8, device),
            gp.cat("counts", torch.int32, device),
            offsets,
            gp.cat("masks", torch.uint8, device),
            values,
        ):
            raw = section.reshape(-1).view(torch.uint8)
            out.append(raw)
            gap = padded(raw.numel()) - raw.numel()
            if gap:
                out.append(torch.zeros(gap, dtype=torch.uint8, device=device))
    return torch.cat(out)


def _bytes(b: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)
