"""Tensors laid out in one flat buffer per device: a model's worth of memory, registered once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from transport.bulk import bulk
from transport.host_copy import HostCopies, native


@bulk
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
    to = None if device is None else torch.device(device)
    sizes: dict[torch.device, int] = {}
    place: dict[str, tuple[torch.device, int]] = {}
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        size = t.element_size()
        dev = t.device if to is None else to
        at = -(-sizes.get(dev, 0) // size) * size
        place[name] = (dev, at)
        sizes[dev] = at + nbytes
    buffers = {dev: torch.empty(-(-n // 16) * 16, dtype=torch.uint8, device=dev)
               for dev, n in sizes.items()}  # fmt: skip
    typed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    strides: dict[torch.Size, tuple[int, ...]] = {}  # a model has few distinct shapes
    out = {}
    for name, t in named.items():
        if name not in place:
            out[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device if to is None else to)
            continue
        dev, at = place[name]
        view = typed.get((dev, t.dtype))
        if view is None:
            view = typed[(dev, t.dtype)] = buffers[dev].view(t.dtype)
        # one view per tensor (slicing, then viewing twice, costs three)
        shape = t.shape
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = _contiguous(shape)
        out[name] = view.as_strided(shape, stride, at // t.element_size())
    return out


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


@bulk
def copy_runs(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> CopyRuns:
    """The byte runs that copy every tensor of ``src`` into the tensor of the same name in
    ``dst`` (same shapes and dtypes): tensors adjacent in both memories (contiguous, in the same
    storages, with nothing between them), in ``dst``'s order, merge into one run, so between two
    flat layouts of one model the copy is one run per buffer, not one per tensor. Worked out on
    arrays of addresses: a model of 100,000 tensors costs a few calls per tensor, once."""
    pairs = [(d, src[name]) for name, d in dst.items() if d.numel()]
    if not pairs:
        return CopyRuns([], [])
    ds = [d for d, _ in pairs]
    ss = [s for _, s in pairs]
    d_at, s_at = _column(d.data_ptr() for d in ds), _column(s.data_ptr() for s in ss)
    d_base = _column(d.untyped_storage().data_ptr() for d in ds)
    s_base = _column(s.untyped_storage().data_ptr() for s in ss)
    nbytes = _column(d.nbytes for d in ds)
    dense = np.array([d.is_contiguous() and s.is_contiguous() for d, s in pairs])
    # a tensor continues the run before it where both sides continue it, byte for byte
    joins = np.zeros(len(pairs), dtype=bool)
    joins[1:] = (
        dense[1:]
        & dense[:-1]
        & (d_base[1:] == d_base[:-1])
        & (s_base[1:] == s_base[:-1])
        & (d_at[1:] == d_at[:-1] + nbytes[:-1])
        & (s_at[1:] == s_at[:-1] + nbytes[:-1])
    )
    starts = np.flatnonzero(~joins)
    sizes = np.add.reduceat(nbytes, starts)
    if native() and dense.all() and all(t.is_cpu for t in (*ds, *ss)):
        # the runs are pairs of one size by construction: their addresses, unchecked again
        host = HostCopies(d_at[starts], s_at[starts], sizes, keep=(ds, ss))
        return CopyRuns([], [], host)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for first, n, alone in zip(
        starts.tolist(),
        sizes.tolist(),
        (np.diff(starts, append=len(ds)) == 1).tolist(),
        strict=True,
    ):
        dsts.append(ds[first] if alone else storage_bytes(ds[first], n))
        srcs.append(ss[first] if alone else storage_bytes(ss[first], n))
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
