"""Batches: named tensors checked and signed once, for transfers repeated every step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transport.gc_pause import without_gc
from transport.memory.local import check_tensor

#: the (region name, tensor) pairs of a transfer
Items = tuple[tuple[str, torch.Tensor], ...]
#: where the tensors of a transfer go in their regions, in elements: one offset for all of them,
#: or one per item (a batch of writes at offsets, :func:`make_batch` of triples)
Offset = int | tuple[int, ...]


class Frozen(tuple):  # type: ignore[type-arg]
    """A tuple that hashes its items once: a batch's signature and offsets key the plan cache at
    every transfer, and hashing 100,000 entries each time would cost milliseconds."""

    def __hash__(self) -> int:
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


@dataclass(frozen=True, eq=False)
class Batch:
    """Named tensors frozen for repeated transfers (``Transport.batch``): checked once and their
    plan's signature computed once, so a put of a model of 100,000 tensors does no per-tensor
    work per call. It owns the (name, tensor) pairs as they were when it was made. Rules: the
    tensors must keep their memory (update them in place, as optimizers do: a tensor given new
    storage is not what the batch sends); changing the dict it was made from changes nothing."""

    items: Items
    sig: tuple[Any, ...]
    #: per item, its offset in elements of its region (a batch made from triples), else None
    offsets: tuple[int, ...] | None = None

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
        sig = Frozen([(k, t.data_ptr(), t.nbytes, t.dtype) for k, t in items])
        contiguous = all([t.is_contiguous() for _, t in items])
    except (AttributeError, TypeError, RuntimeError):
        contiguous = False
    if not contiguous:
        for k, t in items:
            check_tensor(t, f"tensor {k!r}")
    return items, sig


@without_gc
def make_batch(
    tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor, int]],
) -> Batch:
    """A Batch of ``tensors``: a dict region name -> tensor (each tensor at the start of its
    region), or a sequence of ``(region name, tensor, offset in elements)`` triples (every name
    a str, every tensor passing the transfer checks, every offset a non-negative int)."""
    if isinstance(tensors, Mapping):
        for k, t in tensors.items():
            _check_item(k, t)
        items, sig = mapping_items(tensors)
        return Batch(items, sig)
    if not isinstance(tensors, Sequence) or isinstance(tensors, (str, bytes)):
        raise TypeError(
            "a batch is made from a dict of name -> tensor or a list of (name, tensor, offset), "
            f"got {type(tensors).__name__}"
        )
    if not tensors:
        raise ValueError("the list of (name, tensor, offset) is empty")
    pairs, offsets = [], []
    for entry in tensors:
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise TypeError(
                f"each entry of a batch list is (region name, tensor, offset), got {entry!r:.80}"
            )
        k, t, at = entry
        _check_item(k, t)
        if type(at) is not int or at < 0:
            raise ValueError(
                f"offset of {k!r} must be a non-negative int (elements of the region), got {at!r}"
            )
        pairs.append((k, t))
        offsets.append(at)
    items = tuple(pairs)
    sig = Frozen(
        [
            (k, t.data_ptr(), t.nbytes, t.dtype, at)
            for (k, t), at in zip(items, offsets, strict=True)
        ]
    )
    return Batch(items, sig, Frozen(offsets))


def _check_item(k: object, t: torch.Tensor) -> None:
    if not isinstance(k, str):
        raise TypeError(f"dict keys must be region names (str), got {type(k).__name__}")
    check_tensor(t, f"tensor {k!r}")
