"""Small, separately allocated tensors of a publisher, copied into one buffer, the pack, so that
writing them is a handful of descriptors instead of one per tensor.

For a trainer of at most ``UNPACKED_MAX_TENSORS`` tensors, a subscriber whose
connection copies in the kernel (a process of this machine, reached through cross-memory attach)
takes them as they are instead, one system call for all of them; the WeightPublisher then fills
the pack for a version only when a write reads it (none when every subscriber is such), and a late
joiner's pull() reads the tensors themselves. A trainer of more tensors exposes the pack for
pull() and fills it at every publish: a registration a tensor would cost more than the copy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from transport.contract import HostCopies, native, without_gc
from transport.weights.layouts import flat_like
from transport.weights.layouts.flat import storage_bytes

#: tensors of at most this many bytes are packed: below it, one descriptor per subscriber costs
#: more than copying the tensor once for all of them
PACK_TENSOR_BYTES = 32 << 10
#: fewer such tensors than this are written as they are (a buffer is not worth it)
PACK_MIN_TENSORS = 64
#: the pack holds at most this many bytes; the small tensors past it are written as they are
PACK_MAX_BYTES = 1 << 30
#: a publisher of at most this many tensors writes them as they are to subscribers whose
#: connections copy in the kernel: each is a registration of its own (half the Transport's budget
#: of implicit ones, which evicts past it and plans again at every publish) and a row of its plan;
#: a model of more goes through the pack, whose one copy then costs less, and exposes it for pull()
UNPACKED_MAX_TENSORS = 512


class Pack:
    """The packed copies of a publisher's small tensors: ``sources`` is what the publisher writes
    to the members that take the pack (each packed name a view into one host buffer, every other
    name its own tensor), :meth:`fill` copies the tensors' current values into the buffer.
    ``exposed`` (more than ``UNPACKED_MAX_TENSORS`` tensors): the publisher exposes the buffer for
    a late joiner's pull() (else the tensors themselves) and fills it at every publish; ``holds``:
    the version of the last fill.

    Rules: a tensor is packed when it is in host memory, contiguous, holds at most
    ``PACK_TENSOR_BYTES`` and shares its storage with neither of its neighbours in the publisher's
    order (tensors laid out in one flat buffer already merge into few descriptors; they are left
    alone). The buffer is laid out in the publisher's order, packed as ``flat_like`` packs a
    subscriber's staging slot, so tensors adjacent in a subscriber are adjacent here too and their
    writes merge; the alignment gaps between tensors of two dtypes hold zeros. The copy is one call
    for all of them: the compiled :class:`~transport.host_copy.HostCopies` (a memcpy a tensor),
    or one numpy call where it was not built (about a third of a microsecond a tensor more). The
    pack holds the storages it copies from, and the tensors must keep their memory (update them in
    place), as for any batch.
    """

    @without_gc
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        chosen = packable(tensors)
        views = flat_like({n: tensors[n] for n in chosen}) if chosen else {}
        self.names = tuple(chosen)
        # what a late joiner's pull() reads; else the tensors themselves, written as they are
        # where the kernel copies
        self.exposed = bool(chosen) and len(tensors) > UNPACKED_MAX_TENSORS
        self.holds = -1  # the version its copies were made for (-1: none)
        self.sources = {n: views.get(n, t) for n, t in tensors.items()}
        self.nbytes = 0
        self._parts: list[np.ndarray] = []  # the sources' bytes, and the gaps, in buffer order
        self._out: np.ndarray | None = None
        self._copies: HostCopies | None = None
        # the memory copied from, held while the pack lives
        self._keep = [tensors[n].untyped_storage() for n in chosen]
        if not chosen:
            return
        first = views[chosen[0]]
        base = first.data_ptr()
        into = np.fromiter((views[n].data_ptr() for n in chosen), np.int64, len(chosen))
        sizes = np.fromiter((tensors[n].nbytes for n in chosen), np.int64, len(chosen))
        self.nbytes = int((into + sizes).max()) - base
        buffer = storage_bytes(first, self.nbytes)
        if native() is not None:
            buffer.zero_()  # the gaps; the copies never write them
            self._copies = HostCopies(
                into,
                np.fromiter((tensors[n].data_ptr() for n in chosen), np.int64, len(chosen)),
                sizes,
                keep=(buffer, self._keep),
            )
            return
        end = 0
        for n in chosen:
            at = views[n].data_ptr() - base
            if at > end:
                self._parts.append(np.zeros(at - end, dtype=np.uint8))
            self._parts.append(_array(tensors[n]))
            end = at + tensors[n].nbytes
        self._out = buffer.numpy()

    def fill(self, version: int = -1) -> None:
        """Copy every packed tensor's current value into its place in the buffer, as the values
        of ``version``."""
        self.holds = -1  # none while it copies
        if self._copies is not None:
            self._copies.run()
        elif self._out is not None:
            np.concatenate(self._parts, out=self._out)
        self.holds = version


def packable(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names :class:`Pack` packs, in order (none if fewer than ``PACK_MIN_TENSORS``)."""
    items = list(tensors.items())
    storages = [(t.device, t.untyped_storage().data_ptr()) for _, t in items]
    out, total = [], 0
    for i, (name, t) in enumerate(items):
        nbytes = t.nbytes
        if not t.is_cpu or not 0 < nbytes <= PACK_TENSOR_BYTES or not t.is_contiguous():
            continue
        before = i > 0 and storages[i - 1] == storages[i]
        after = i + 1 < len(items) and storages[i] == storages[i + 1]
        if before or after or total + nbytes > PACK_MAX_BYTES:
            continue
        out.append(name)
        total += nbytes
    return out if len(out) >= PACK_MIN_TENSORS else []


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


def _array(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a numpy array over its memory (no copy)."""
    if t.dtype in _NUMPY_DTYPES and not t.requires_grad:
        return t.numpy().ravel().view(np.uint8)
    return t.detach().reshape(-1).view(torch.uint8).numpy()
