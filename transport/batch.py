"""Batches: named tensors checked and signed once, for transfers repeated every step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from transport.memory import check_tensor

#: the (region name, tensor) pairs of a transfer
Items = tuple[tuple[str, torch.Tensor], ...]


@dataclass(frozen=True, eq=False)
class Batch:
    """Named tensors frozen for repeated transfers (``Transport.batch``): checked once and their
    plan's signature computed once, so a put of a model of 100,000 tensors does no per-tensor
    work per call. It owns the (name, tensor) pairs as they were when it was made. Rules: the
    tensors must keep their memory (update them in place, as optimizers do: a tensor given new
    storage is not what the batch sends); changing the dict it was made from changes nothing."""

    items: Items
    sig: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.items)


def mapping_items(obj: Mapping[str, torch.Tensor]) -> tuple[Items, tuple[Any, ...]]:
    """The pairs of a dict of tensors and its plan's signature. The signature is all a cached
    plan needs; full checks run when a plan is built (a tensor matching a cached plan's
    pointer, size and dtype is that same memory, so only its layout can have changed)."""
    if not obj:
        raise ValueError("the dict of tensors is empty")
    items = tuple(obj.items())
    try:
        sig = tuple([(k, t.data_ptr(), t.nbytes, t.dtype) for k, t in items])
        contiguous = all([t.is_contiguous() for _, t in items])
    except (AttributeError, TypeError, RuntimeError):
        contiguous = False
    if not contiguous:
        for k, t in items:
            check_tensor(t, f"tensor {k!r}")
    return items, sig


def make_batch(tensors: Mapping[str, torch.Tensor]) -> Batch:
    """A Batch of ``tensors`` (every name a str, every tensor passing the transfer checks)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"a batch is made from a dict of name -> tensor, got {type(tensors).__name__}"
        )
    for k, t in tensors.items():
        if not isinstance(k, str):
            raise TypeError(f"dict keys must be region names (str), got {type(k).__name__}")
        check_tensor(t, f"tensor {k!r}")
    items, sig = mapping_items(tensors)
    return Batch(items, sig)
