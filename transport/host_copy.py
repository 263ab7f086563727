"""Many host-memory copies in one call, through the library's one compiled helper
(csrc/host_copy.c, built at install time as ``transport._host_copy``)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

#: below this many bytes in all, one thread copies (starting threads costs more than it saves)
THREAD_BYTES = 16 << 20
#: at most this many threads copy at once (memory bandwidth, not cores, bounds a copy)
MAX_THREADS = 4


@cache
def native() -> ctypes.CDLL | None:
    """The compiled helper, or None where it was not built (no C compiler at install time)."""
    spec = importlib.util.find_spec("transport._host_copy")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    fn = lib.transport_host_copy
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


class HostCopies:
    """A fixed list of copies in host memory, done in one call of the compiled helper each time
    :meth:`run` is called: ``nbytes[i]`` bytes from address ``srcs[i]`` to address ``dsts[i]``.

    It owns the copies' addresses (three arrays of 64-bit words) and holds ``keep``, whatever
    keeps that memory alive (tensors, storages), as long as it lives. Rules: it is built only
    where :func:`native` is there, from addresses of host memory that stays where it is (a
    tensor given new storage since is copied from its old one); :meth:`between` builds it from
    tensors and checks them. A total over ``THREAD_BYTES`` is split over up to ``MAX_THREADS``
    threads (the helper lets go of the GIL meanwhile).
    """

    def __init__(
        self,
        dsts: Sequence[int] | np.ndarray,
        srcs: Sequence[int] | np.ndarray,
        nbytes: Sequence[int] | np.ndarray,
        *,
        keep: object,
    ) -> None:
        lib = native()
        if lib is None:
            raise RuntimeError("transport._host_copy was not built (no C compiler at install time)")
        if not len(dsts) == len(srcs) == len(nbytes):
            raise ValueError(f"{len(dsts)} destinations, {len(srcs)} sources, {len(nbytes)} sizes")
        self._lib, self._keep, self.count = lib, keep, len(dsts)
        self._words = np.array([dsts, srcs, nbytes], dtype=np.uint64).reshape(3, self.count)
        self.nbytes = int(self._words[2].sum())
        cores = os.cpu_count() or 1
        self._threads = 1 if self.nbytes < THREAD_BYTES else max(1, min(MAX_THREADS, cores))

    @classmethod
    def between(cls, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> HostCopies:
        """Each of ``dsts`` takes the bytes of the source at its index: host tensors, contiguous,
        each pair of the same size in bytes."""
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
        for d, s in zip(dsts, srcs, strict=True):
            if d.device.type != "cpu" or s.device.type != "cpu":
                raise ValueError(f"host copies take host tensors, not {d.device} <- {s.device}")
            if not (d.is_contiguous() and s.is_contiguous()):
                raise ValueError("host copies take contiguous tensors")
            if d.nbytes != s.nbytes:
                raise ValueError(f"a copy of {s.nbytes} bytes into {d.nbytes}")
        return cls(
            [d.data_ptr() for d in dsts],
            [s.data_ptr() for s in srcs],
            [d.nbytes for d in dsts],
            keep=(list(dsts), list(srcs)),
        )

    def run(self) -> None:
        """Do every copy."""
        if self.count:
            at = self._words.ctypes.data
            n = self.count
            self._lib.transport_host_copy(at, at + 8 * n, at + 16 * n, n, self._threads)
