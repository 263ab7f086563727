"""Tensors laid out in one flat buffer per device: a model's worth of memory, registered once."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def flat_like(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Uninitialised tensors shaped and typed like ``named``, each a view into one flat buffer
    per device, in ``named``'s order, packed (each starts at the next multiple of its element
    size): the backend registers each buffer once, however many tensors a model has (a mixture
    of experts has tens of thousands), and a transfer between two such layouts of the same
    tensors is a handful of descriptors (plan.coalesce merges what is adjacent at both ends). A
    tensor without elements gets a buffer of its own (nothing to register)."""
    sizes: dict[torch.device, int] = {}
    place: dict[str, tuple[torch.device, int]] = {}
    for name, t in named.items():
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        size = t.element_size()
        at = -(-sizes.get(t.device, 0) // size) * size
        place[name] = (t.device, at)
        sizes[t.device] = at + nbytes
    buffers = {dev: torch.empty(-(-n // 16) * 16, dtype=torch.uint8, device=dev)
               for dev, n in sizes.items()}  # fmt: skip
    typed: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    out = {}
    for name, t in named.items():
        if name not in place:
            out[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
            continue
        dev, at = place[name]
        view = typed.get((dev, t.dtype))
        if view is None:
            view = typed[(dev, t.dtype)] = buffers[dev].view(t.dtype)
        # one view per tensor (slicing and viewing twice took four times as long)
        out[name] = view.as_strided(t.shape, _contiguous(t.shape), at // t.element_size())
    return out


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))
