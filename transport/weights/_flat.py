"""Tensors laid out in one flat buffer per device: a model's worth of memory, registered once."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from transport.host_copy import HostCopies, native


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


def copy_runs(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> CopyRuns:
    """The byte runs that copy every tensor of ``src`` into the tensor of the same name in
    ``dst`` (same shapes and dtypes, contiguous): tensors adjacent in both memories (in the same
    storages, with nothing between them), in ``dst``'s order, merge into one run, so between two
    flat layouts of one model the copy is one run per buffer, not one per tensor."""
    runs: list[list[torch.Tensor]] = []  # the (dst, src) tensors of each run
    end: tuple[int, ...] = ()  # of the open run: dst storage, dst end, src storage, src end
    for name, d in dst.items():
        s = src[name]
        n = int(d.numel()) * d.element_size()
        if n == 0:
            continue
        da, sa = d.data_ptr(), s.data_ptr()
        # a storage is known by its start: where the tensor starts less its offset
        dst_st, src_st = (
            da - int(d.storage_offset()) * d.element_size(),
            sa - int(s.storage_offset()) * s.element_size(),
        )
        if runs and end == (dst_st, da, src_st, sa):
            runs[-1].extend((d, s))
        else:
            runs.append([d, s])
        end = (dst_st, da + n, src_st, sa + n)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for run in runs:
        if len(run) == 2:
            dsts.append(run[0])
            srcs.append(run[1])
            continue
        first_d, first_s, last_d = run[0], run[1], run[-2]
        n = last_d.data_ptr() + last_d.numel() * last_d.element_size() - first_d.data_ptr()
        dsts.append(storage_bytes(first_d, n))
        srcs.append(storage_bytes(first_s, n))
    return CopyRuns(dsts, srcs)


class CopyRuns:
    """A copy plan made once and run at every copy: each of ``dsts`` takes the bytes of the
    source at its index (byte runs of the same size, contiguous).

    It owns the runs. Rules: where every run is in host memory and the compiled helper is there,
    the runs are one call of :class:`~transport.host_copy.HostCopies` (a memcpy a run); else one
    call into torch for all of them (a fraction of a microsecond more per run, and device copies).
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        self.dsts, self.srcs = dsts, srcs
        self._host: HostCopies | None = None
        both = (*dsts, *srcs)
        if native() and all(t.device.type == "cpu" and t.is_contiguous() for t in both):
            # the runs are pairs of one size by construction: their addresses, unchecked again
            self._host = HostCopies(
                [d.data_ptr() for d in dsts],
                [s.data_ptr() for s in srcs],
                [d.nbytes for d in dsts],
                keep=both,
            )

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
