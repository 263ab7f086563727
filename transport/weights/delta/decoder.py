"""A peer's blob of changes checked rule by rule, then applied onto the base, bit for bit.

A blob is a peer's bytes (weights/delta/codec.py says its format): :func:`decode` checks every
rule before anything is written (sizes, order, ranges, that counts match the masks and
offsets; a broken rule is a :class:`~.codec.DeltaError`) and gives each width group's changes as
positions and values; :func:`apply` writes them into the tensors that hold the base, a run of
tensors that share one storage (a flat buffer) in one operation.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from transport import DeltaError
from transport.weights.delta.codec import (
    CHUNK,
    CHUNK_BITS,
    FORMAT,
    GROUP_HEAD,
    HEAD,
    INTS,
    MAGIC,
    MASK,
    SPARSE,
    WHOLE,
    DeltaLayout,
    Group,
    padded,
)

#: unpacking a byte: copied into all 8 bytes, byte j keeps only bit j
_SPREAD, _PICK = 0x0101010101010101, -0x7FBFDFEFF7FBFDFF  # 0x8040201008040201 as an int64


def _unpack_bits(masks: torch.Tensor) -> torch.Tensor:
    """A blob's MASK section, (rows, CHUNK // 8) uint8, as (rows, CHUNK) bool: element j of
    every 8 at bit j (codec._pack_bits made it)."""
    spread = (masks.to(torch.int64) * _SPREAD) & _PICK
    return spread.view(torch.uint8).ne(0).view(masks.shape[0], CHUNK)


@dataclass(frozen=True)
class Changes:
    """One width group's changes, checked: ``positions`` (int64, virtual, increasing) and the
    ``values`` (``width``-byte integers) to write there."""

    group: Group
    positions: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Decoded:
    """A blob's changes, checked: ``version`` made out of ``base``, one :class:`Changes` per
    width group of the layout."""

    version: int
    base: int
    groups: tuple[Changes, ...]


class _Reader:
    """Reads sections off a blob, bounds checked."""

    def __init__(self, blob: torch.Tensor) -> None:
        self.blob = blob
        self.at = 0

    def take(self, n: int, what: str) -> torch.Tensor:
        if n < 0 or self.at + n > self.blob.numel():
            raise DeltaError(f"delta: its {what} runs past its end ({self.blob.numel()} bytes)")
        out = self.blob[self.at : self.at + n]
        self.at += padded(n)
        return out

    def head(self, fmt: struct.Struct, what: str) -> tuple:
        raw = bytes(self.take(fmt.size, what).cpu().numpy())
        return fmt.unpack(raw)


def decode(layout: DeltaLayout, blob: torch.Tensor, version: int, base: int) -> Decoded:
    """The blob's changes, every rule checked (:class:`DeltaError` names the one broken)."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise DeltaError("delta: a blob is a flat uint8 tensor")
    r = _Reader(blob)
    magic, fmt, ngroups, digest, v, b = r.head(HEAD, "header")
    if magic != MAGIC or fmt != FORMAT:
        raise DeltaError(f"delta: not a delta of format {FORMAT} (magic {magic!r}, format {fmt})")
    if digest != layout.digest:
        raise DeltaError("delta: made for other tensors (its layout digest differs from ours)")
    if (v, b) != (version, base):
        raise DeltaError(
            f"delta: it holds version {v} on base {b}, its message says {version} on {base}"
        )
    if ngroups != len(layout.groups):
        raise DeltaError(f"delta: {ngroups} width groups, the layout has {len(layout.groups)}")
    out = tuple(_decode_group(r, g) for g in layout.groups)
    if r.at != padded(blob.numel()):
        raise DeltaError(f"delta: {blob.numel() - r.at} bytes past its last section")
    return Decoded(version, base, out)


def _decode_group(r: _Reader, group: Group) -> Changes:
    width, n, noff, nval = r.head(GROUP_HEAD, "group header")
    if width != group.width:
        raise DeltaError(f"delta: a group of width {width} where the layout has {group.width}")
    if n > group.chunks or noff > group.total or nval > group.total:
        raise DeltaError("delta: more chunks, offsets or values than the group has elements")
    device = r.blob.device
    ids = r.take(n * 4, "chunk ids").view(torch.int32).to(torch.int64)
    kinds = r.take(n, "chunk kinds").to(torch.int64)
    counts = r.take(n * 4, "chunk counts").view(torch.int32).to(torch.int64)
    if n and (int(ids[0]) < 0 or int(ids[-1]) >= group.chunks or bool((ids[1:] <= ids[:-1]).any())):
        raise DeltaError("delta: chunk ids must increase strictly and name chunks of the group")
    if bool(((kinds < SPARSE) | (kinds > WHOLE)).any()):
        raise DeltaError("delta: a chunk kind is not sparse, mask or whole")
    lens = torch.clamp(group.total - ids * CHUNK, max=CHUNK)
    whole, sparse, masked = kinds == WHOLE, kinds == SPARSE, kinds == MASK
    if bool((counts < 1).any()) or bool((counts > lens).any()):
        raise DeltaError("delta: a chunk's count is not between 1 and its length")
    if bool((whole & (counts != lens)).any()):
        raise DeltaError("delta: a whole chunk must carry every element")
    if int(counts[sparse].sum()) != noff or int(counts.sum()) != nval:
        raise DeltaError("delta: the chunks' counts do not add up to its offsets and values")
    offsets = r.take(noff * 2, "offsets").view(torch.int16).to(torch.int64) & 0xFFFF
    nmask = int(masked.sum())
    masks = r.take(nmask * (CHUNK // 8), "masks").view(nmask, CHUNK // 8)
    values = r.take(nval * width, "values").view(INTS[width])
    # where each chunk's values start
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.empty(nval, dtype=torch.int64, device=device)
    if noff:
        per = counts[sparse]
        chunk_of = torch.repeat_interleave(torch.arange(per.numel(), device=device), per)
        first = torch.cumsum(per, 0) - per
        rank = torch.arange(noff, device=device) - first[chunk_of]
        sparse_ids, sparse_lens = ids[sparse], lens[sparse]
        if bool((offsets >= sparse_lens[chunk_of]).any()):
            raise DeltaError("delta: an offset lies past the end of its chunk")
        if noff > 1 and bool(((offsets[1:] <= offsets[:-1]) & (rank[1:] > 0)).any()):
            raise DeltaError("delta: offsets must increase strictly within a chunk")
        positions[starts[sparse][chunk_of] + rank] = sparse_ids[chunk_of] * CHUNK + offsets
    if nmask:
        bits = _unpack_bits(masks)
        mask_lens = lens[masked]
        short = torch.nonzero(mask_lens < CHUNK).flatten()  # only a group's last chunk is
        if short.numel():
            beyond = torch.arange(CHUNK, device=device).unsqueeze(0) >= mask_lens[short, None]
            if bool((bits[short] & beyond).any()):
                raise DeltaError("delta: a mask marks elements past the end of its chunk")
        mask_counts = counts[masked]
        # (summed as bytes into int32: a bool or int64 sum is several times slower)
        if bool((bits.view(torch.uint8).sum(1, dtype=torch.int32) != mask_counts).any()):
            raise DeltaError("delta: a mask's bits do not match its chunk's count")
        flat = torch.nonzero(bits.view(-1)).flatten()  # row * CHUNK + col, in order
        mask_ids, mask_starts = ids[masked], starts[masked]
        first = mask_starts[0]
        if bool((mask_ids - mask_ids[0] == torch.arange(nmask, device=device)).all()) and bool(
            (mask_starts - first == torch.cumsum(mask_counts, 0) - mask_counts).all()
        ):  # consecutive chunks whose values lie together (a dense version): no gathers
            positions[first : first + flat.numel()] = flat + mask_ids[0] * CHUNK
        else:  # a mask chunk's k-th value goes to its start + k, at its first element + col
            row = flat >> CHUNK_BITS
            shift = mask_starts - (torch.cumsum(mask_counts, 0) - mask_counts)
            to = torch.arange(flat.numel(), device=device) + shift[row]
            positions[to] = flat + ((mask_ids - torch.arange(nmask, device=device)) * CHUNK)[row]
    if bool(whole.any()):
        per = counts[whole]
        chunk_of = torch.repeat_interleave(torch.arange(per.numel(), device=device), per)
        first = torch.cumsum(per, 0) - per
        rank = torch.arange(int(per.sum()), device=device) - first[chunk_of]
        positions[starts[whole][chunk_of] + rank] = ids[whole][chunk_of] * CHUNK + rank
    return Changes(group, positions, values)


def apply(decoded: Decoded, targets: Mapping[str, torch.Tensor]) -> int:
    """Write ``decoded``'s changes into ``targets`` (the layout's tensors, contiguous, holding
    exactly the base); returns how many elements were written. Tensors that share a storage
    (a flat buffer) are written in one operation."""
    written = 0
    for ch in decoded.groups:
        if ch.positions.numel() == 0:
            continue
        starts = torch.tensor([s.start for s in ch.group.spans], device=ch.positions.device)
        bounds = torch.searchsorted(ch.positions, starts).tolist() + [ch.positions.numel()]
        for run, lo, hi in _runs(ch.group, bounds, targets):
            pos = ch.positions[lo:hi]
            run(pos, ch.values[lo:hi])
        written += ch.positions.numel()
    return written


def patch(
    layout: DeltaLayout,
    blob: torch.Tensor,
    version: int,
    base: int,
    targets: Mapping[str, torch.Tensor],
) -> int:
    """The changes in ``blob`` (made for ``layout``, from ``base`` to ``version``) checked
    whole, then applied onto ``targets``: the one way both protocols apply a delta (a weight
    group's inbox, a bucket's changes). DeltaError, with nothing written, when they break a
    rule of their format or were made for other tensors or another base."""
    return apply(decode(layout, blob, version, base), targets)


def _runs(
    group: Group, bounds: list[int], targets: Mapping[str, torch.Tensor]
) -> Iterator[tuple[Callable[[torch.Tensor, torch.Tensor], None], int, int]]:
    """Per run of consecutive tensors that share one storage (a flat buffer holds them all):
    the write of that run, and the range of changes it takes."""
    w = group.width
    spans = group.spans
    k = 0
    while k < len(spans):
        if bounds[k] == bounds[k + 1]:
            k += 1
            continue
        storage = targets[spans[k].name].untyped_storage()
        j = k + 1
        while j < len(spans) and (
            targets[spans[j].name].untyped_storage().data_ptr() == storage.data_ptr()
        ):
            j += 1
        # storage element (in units of w) = virtual position + the tensor's shift
        shifts = [
            targets[s.name].storage_offset() * targets[s.name].element_size() // w - s.start
            for s in spans[k:j]
        ]
        counts = [bounds[i + 1] - bounds[i] for i in range(k, j)]
        device = targets[spans[k].name].device
        flat = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        ints = flat[: storage.nbytes() // w * w].view(INTS[w])
        if len(set(shifts)) == 1:
            shift: int | torch.Tensor = shifts[0]
        else:
            shift = torch.repeat_interleave(
                torch.tensor(shifts, device=device), torch.tensor(counts, device=device)
            )

        def write(pos: torch.Tensor, vals: torch.Tensor, ints=ints, shift=shift) -> None:
            ints[pos + shift] = vals

        yield write, bounds[k], bounds[j]
        k = j
