"""Tensors laid out in one flat buffer per device: a model's worth of memory, registered once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from transport.contract import HostCopies, native, without_gc


def flat_like(
    named: Mapping[str, torch.Tensor], device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Uninitialised tensors shaped and typed like ``named`` (on ``device`` when given, else each
    on its own), each a view into one flat buffer per device, in ``named``'s order, packed (each
    starts at the next multiple of its element size): the backend registers each buffer once,
    however many tensors a model has (a mixture of experts has tens of thousands), and a transfer
    between two such layouts of the same tensors is a handful of descriptors (plan.coalesce merges
    what is adjacent at both ends). A tensor without elements gets a buffer of its own (nothing to
    register)."""
    return flat_copies(named, 1, device)[0]


@without_gc
def flat_copies(
    named: Mapping[str, torch.Tensor], count: int, device: torch.device | str | None = None
) -> list[dict[str, torch.Tensor]]:
    """``count`` layouts of :func:`flat_like`, each in buffers of its own (a subscriber's staging
    slots), laid out once."""
    to = None if device is None else torch.device(device)
    sizes: dict[torch.device, int] = {}
    strides: dict[torch.Size, tuple[int, ...]] = {}  # a model has few distinct shapes
    # per tensor: its device and dtype, shape, strides and offset in elements (None: no elements)
    places: list[tuple[torch.device, torch.dtype, torch.Size, tuple[int, ...], int] | None]
    places, empty = [], {}
    for name, t in named.items():
        size = t.element_size()
        nbytes = t.numel() * size
        dev = t.device if to is None else to
        if nbytes == 0:
            empty[name] = (t.shape, t.dtype, dev)
            places.append(None)
            continue
        at = -(-sizes.get(dev, 0) // size) * size
        sizes[dev] = at + nbytes
        shape = t.shape
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = _contiguous(shape)
        places.append((dev, t.dtype, shape, stride, at // size))
    out = []
    for _ in range(count):
        buffers = {
            dev: torch.empty(-(-n // 16) * 16, dtype=torch.uint8, device=dev)
            for dev, n in sizes.items()
        }
        typed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        views: dict[str, torch.Tensor] = {}
        for name, place in zip(named, places, strict=True):
            if place is None:
                shape, dtype, dev = empty[name]
                views[name] = torch.empty(shape, dtype=dtype, device=dev)
                continue
            dev, dtype, shape, stride, offset = place
            view = typed.get((dev, dtype))
            if view is None:
                view = typed[(dev, dtype)] = buffers[dev].view(dtype)
            # one view per tensor (slicing, then viewing twice, costs three)
            views[name] = view.as_strided(shape, stride, offset)
        out.append(views)
    return out


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def copy_runs(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> CopyRuns:
    """The byte runs that copy every tensor of ``src`` into the tensor of the same name in
    ``dst`` (same shapes and dtypes): tensors adjacent in both memories (contiguous, in the same
    storages, with nothing between them), in ``dst``'s order, merge into one run, so between two
    flat layouts of one model the copy is one run per buffer, not one per tensor. Worked out on
    arrays of addresses: a model of 100,000 tensors costs a few calls per tensor, once."""
    return copy_runs_from(dst, [src])[0]


@without_gc
def copy_runs_from(
    dst: Mapping[str, torch.Tensor], srcs: Sequence[Mapping[str, torch.Tensor]]
) -> list[CopyRuns]:
    """:func:`copy_runs` into ``dst`` from each of ``srcs`` (a subscriber's staging slots into
    its live tensors), ``dst``'s addresses read once."""
    names = [name for name, d in dst.items() if d.numel()]
    ds = [dst[name] for name in names]
    into = _Side(ds)
    return [_runs(ds, into, [src[name] for name in names]) for src in srcs]


class _Side:
    """One side of a copy, by column: each tensor's address, its storage's, its bytes, and
    whether it is contiguous."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.at = _column(t.data_ptr() for t in tensors)
        self.base = _column(t.untyped_storage().data_ptr() for t in tensors)
        self.nbytes = _column(t.nbytes for t in tensors)
        self.dense = np.fromiter((t.is_contiguous() for t in tensors), bool, len(tensors))
        self.host = all(t.is_cpu for t in tensors)


def _runs(ds: list[torch.Tensor], d: _Side, ss: list[torch.Tensor]) -> CopyRuns:
    if not ds:
        return CopyRuns([], [])
    s = _Side(ss)
    nbytes, dense = d.nbytes, d.dense & s.dense
    # a tensor continues the run before it where both sides continue it, byte for byte
    joins = np.zeros(len(ds), dtype=bool)
    joins[1:] = (
        dense[1:]
        & dense[:-1]
        & (d.base[1:] == d.base[:-1])
        & (s.base[1:] == s.base[:-1])
        & (d.at[1:] == d.at[:-1] + nbytes[:-1])
        & (s.at[1:] == s.at[:-1] + nbytes[:-1])
    )
    starts = np.flatnonzero(~joins)
    sizes = np.add.reduceat(nbytes, starts)
    if native() and dense.all() and d.host and s.host:
        # the runs are pairs of one size by construction: their addresses, unchecked again
        host = HostCopies(d.at[starts], s.at[starts], sizes, keep=(ds, ss))
        return CopyRuns([], [], host)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    alone = (np.diff(starts, append=len(ds)) == 1).tolist()
    for first, n, one in zip(starts.tolist(), sizes.tolist(), alone, strict=True):
        dsts.append(ds[first] if one else storage_bytes(ds[first], n))
        srcs.append(ss[first] if one else storage_bytes(ss[first], n))
    return CopyRuns(dsts, srcs)


def _column(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)


class CopyRuns:
    """A copy plan made once and run at every copy: :attr:`count` runs of bytes.

    It owns the runs. Rules: where every run is in host memory and the compiled helper is there,
    the runs are ``host``, one call of :class:`~transport.host_copy.HostCopies` (a memcpy a run);
    else each of ``dsts`` takes the bytes of the source at its index, in one call into torch for
    all of them (a fraction of a microsecond more per run, and device copies).
    """

    def __init__(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], host: HostCopies | None = None
    ) -> None:
        self.dsts, self.srcs, self._host = dsts, srcs, host
        self.count = host.count if host is not None else len(dsts)

    def run(self) -> None:
        """Copy every run."""
        if self._host is not None:
            self._host.run()
        elif self.dsts:
            torch._foreach_copy_(self.dsts, self.srcs)


def storage_bytes(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` bytes of ``t``'s storage from where ``t`` starts, as a uint8 tensor."""
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    at = t.storage_offset() * t.element_size()
    return whole[at : at + n]
