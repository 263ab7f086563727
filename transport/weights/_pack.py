"""Small, separately allocated tensors of a publisher, copied into one buffer at every publish, so
that writing them is a handful of descriptors instead of one per tensor."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from transport.weights._flat import flat_like

#: tensors of at most this many bytes are packed: below it, one descriptor per subscriber costs
#: more than copying the tensor once for all of them
PACK_TENSOR_BYTES = 32 << 10
#: fewer such tensors than this are written as they are (a buffer is not worth it)
PACK_MIN_TENSORS = 64
#: the pack holds at most this many bytes; the small tensors past it are written as they are
PACK_MAX_BYTES = 1 << 30
#: tensors of one role (their names equal but for the numbers) evenly spaced at both ends are
#: copied as one strided block when there are at least this many in a row
STRIDED_MIN = 8

_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class Rows:
    """``rows`` tensors of ``width`` bytes each (``members``: their places in the pack's order):
    ``src`` views them, ``src_step`` bytes apart, and they go into the pack from byte ``dst`` on,
    ``dst_step`` apart."""

    members: tuple[int, ...]
    src: np.ndarray
    src_step: int
    dst: int
    dst_step: int
    rows: int
    width: int


class Pack:
    """The packed copies of a publisher's small tensors: ``sources`` is what the publisher writes
    and exposes (each packed name a view into one host buffer, every other name its own tensor),
    :meth:`fill` copies the tensors' current values into the buffer.

    Rules: a tensor is packed when it is in host memory, holds at most ``PACK_TENSOR_BYTES`` and
    shares its storage with neither of its neighbours in the publisher's order (tensors laid out
    in one flat buffer already merge into few descriptors; they are left alone). The buffer is
    laid out in the publisher's order, packed as ``flat_like`` packs a subscriber's staging slot,
    so tensors adjacent in a subscriber are adjacent here too and their writes merge.

    The copy: tensors of one role (``layers.3.q`` and ``layers.4.q``) that an allocator placed
    evenly spaced (a model built layer by layer in a fresh heap; an allocator that reuses freed
    chunks seldom does) are copied as one strided block of rows, each row exactly one tensor's
    bytes; the rest in one numpy call per stretch of the buffer (about half a microsecond a
    tensor). The pack holds the storages it copies from, and the tensors must keep their memory
    (update them in place), as for any batch.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        chosen = packable(tensors)
        views = flat_like({n: tensors[n] for n in chosen}) if chosen else {}
        self.names = tuple(chosen)
        self.sources = {n: views.get(n, t) for n, t in tensors.items()}
        self.nbytes = 0
        self.blocks: list[tuple[np.ndarray, np.ndarray]] = []  # (pack rows, source rows)
        self.stretches: list[tuple[np.ndarray, list[np.ndarray]]] = []  # (pack, sources)
        # the memory copied from, held while the pack lives
        self._keep = [tensors[n].untyped_storage() for n in chosen]
        if not chosen:
            return
        first = views[chosen[0]]
        base = first.data_ptr()
        at = [views[n].data_ptr() - base for n in chosen]
        size = [views[n].numel() * views[n].element_size() for n in chosen]
        self.nbytes = at[-1] + size[-1]
        whole = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        out = whole[: self.nbytes].numpy()
        arrays = [_bytes(tensors[n]) for n in chosen]
        in_block = [False] * len(chosen)
        for r in strided_rows(chosen, [tensors[n].data_ptr() for n in chosen], at, size, arrays):
            self.blocks.append((_rows(out, r.dst, r.dst_step, r.rows, r.width), r.src))
            for i in r.members:
                in_block[i] = True
        self._stretches(out, at, size, arrays, in_block)

    def _stretches(
        self,
        out: np.ndarray,
        at: list[int],
        size: list[int],
        arrays: list[np.ndarray],
        in_block: list[bool],
    ) -> None:
        """The tensors no block copies, in runs of the buffer copied by one numpy call each
        (the alignment gaps between them filled with zeros)."""
        start = end = -1
        parts: list[np.ndarray] = []
        for i, array in enumerate(arrays):
            if in_block[i]:
                if parts:
                    self.stretches.append((out[start:end], parts))
                parts = []
                continue
            if not parts:
                start = end = at[i]
            if at[i] > end:
                parts.append(np.zeros(at[i] - end, dtype=np.uint8))
            parts.append(array)
            end = at[i] + size[i]
        if parts:
            self.stretches.append((out[start:end], parts))

    def fill(self) -> None:
        """Copy every packed tensor's current value into its place in the buffer."""
        for dst, src in self.blocks:
            np.copyto(dst, src)
        for out, parts in self.stretches:
            if len(parts) == 1:
                np.copyto(out, parts[0])
            else:
                np.concatenate(parts, out=out)


def packable(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names :class:`Pack` packs, in order (none if fewer than ``PACK_MIN_TENSORS``)."""
    items = list(tensors.items())
    storages = [(t.device, t.untyped_storage().data_ptr()) for _, t in items]
    out, total = [], 0
    for i, (name, t) in enumerate(items):
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or not 0 < nbytes <= PACK_TENSOR_BYTES:
            continue
        before = i > 0 and storages[i - 1] == storages[i]
        after = i + 1 < len(items) and storages[i] == storages[i + 1]
        if before or after or total + nbytes > PACK_MAX_BYTES:
            continue
        out.append(name)
        total += nbytes
    return out if len(out) >= PACK_MIN_TENSORS else []


def strided_rows(
    names: list[str], src: list[int], dst: list[int], size: list[int], arrays: list[np.ndarray]
) -> list[Rows]:
    """Runs of at least ``STRIDED_MIN`` tensors of one role, in order, of one size, evenly spaced
    at their sources (at least a tensor apart: rows never overlap) and in the pack. Each run's
    source is a numpy view whose rows are exactly those tensors' bytes (its first tensor's array,
    strided on to the others: every row is checked to start where its tensor does)."""
    roles: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(names):
        roles[_NUMBER.sub("#", n)].append(i)
    out = []
    for idx in roles.values():
        j = 0
        while j + 1 < len(idx):
            a, b = idx[j], idx[j + 1]
            s_step, d_step, width = src[b] - src[a], dst[b] - dst[a], size[a]
            k = j + 1
            while (
                k < len(idx)
                and size[idx[k]] == width
                and src[idx[k]] - src[idx[k - 1]] == s_step
                and dst[idx[k]] - dst[idx[k - 1]] == d_step
            ):
                k += 1
            if k - j >= STRIDED_MIN and s_step >= width and d_step >= width:
                rows = _rows(arrays[a], 0, s_step, k - j, width)
                out.append(Rows(tuple(idx[j:k]), rows, s_step, dst[a], d_step, k - j, width))
                j = k
            else:
                j += 1
    return out


def _rows(array: np.ndarray, at: int, step: int, rows: int, width: int) -> np.ndarray:
    """``rows`` rows of ``width`` bytes, ``step`` apart, from byte ``at`` of ``array`` on."""
    return np.lib.stride_tricks.as_strided(array[at:], shape=(rows, width), strides=(step, 1))


#: dtypes numpy has (a tensor of one becomes a numpy array in one call)
_NUMPY_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a numpy array over its memory (no copy)."""
    if t.dtype in _NUMPY_DTYPES and not t.requires_grad:
        return t.numpy().ravel().view(np.uint8)
    return t.detach().reshape(-1).view(torch.uint8).numpy()
