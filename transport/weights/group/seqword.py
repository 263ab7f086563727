"""The sequence word a publisher exposes beside its tensors, so that a late joiner's read of them
is never a half-updated state."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import torch

from transport import TransferTimeout, Transport
from transport.weights.group.region_names import PUB_SLOT, SEQ_NAME, region


class SeqWord:
    """The word ``[seq, version]`` (``word``, exposed read-only beside a publisher's tensors):
    ``seq`` is odd while the tensors change, ``version`` names the stable state they hold (-1:
    none yet). A late joiner's pull() reads the word, the tensors, then the word again, and keeps
    what it read only where both words are equal and even.

    It owns the word. Rules: one :meth:`changing` at a time (the trainer's updating()); the
    publisher's own copies (:meth:`filling`) keep the word odd only where updating() does not
    already; :meth:`stamp` names a version only while nothing changes.
    """

    def __init__(self) -> None:
        self.word = torch.tensor([0, -1], dtype=torch.int64)  # no version until the first publish
        # changed through numpy: a torch op lets go of the interpreter lock, and on a publish's
        # path getting it back waits behind whichever thread took it (measured: 200 us a stamp)
        self._w = self.word.numpy()
        self.updating = False

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """The trainer changes the tensors inside: odd, with no version, until the block ends."""
        if self.updating:
            raise RuntimeError("updating() is already active")
        self.updating = True
        self._w[0] += 1  # odd: changing
        self._w[1] = -1  # the new state has no version until publish() names it
        try:
            yield
        finally:
            self._w[0] += 1  # even: stable
            self.updating = False

    @contextlib.contextmanager
    def filling(self) -> Iterator[None]:
        """The publisher's packed copies take the tensors' values inside (odd meanwhile)."""
        odd = 0 if self.updating else 1
        self._w[0] += odd
        try:
            yield
        finally:
            self._w[0] += odd

    def stamp(self, version: int) -> None:
        """Name the stable state ``version`` for pull() (not while it changes)."""
        if not self.updating and self._w[0] % 2 == 0:
            self._w[1] = version


def read_stable(
    transport: Transport,
    group: str,
    publisher: str,
    tensors: Mapping[str, torch.Tensor],
    timeout: float | None,
    guard: Callable[[], contextlib.AbstractContextManager[None]],
) -> int:
    """Read the tensors ``publisher`` exposes for ``group`` into ``tensors`` (one-sided READs)
    until a read found the word even and the same before and after; returns the version it
    named. ``guard()`` is held around each read of the tensors. TransferTimeout when no read
    was stable within ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    seq = torch.zeros(2, dtype=torch.int64)
    seq_region = region(group, PUB_SLOT, SEQ_NAME)
    dst = {region(group, PUB_SLOT, n): t for n, t in tensors.items()}
    delay = 0.001
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TransferTimeout(
                f"could not read a stable state of group {group!r} from {publisher!r} within "
                f"{timeout:.3g} s: it was changing the tensors the whole time (or never called publish)"
            )
        transport.get(seq, publisher, seq_region, timeout=left).wait()
        first, version = int(seq[0]), int(seq[1])
        if first % 2 == 0 and version >= 0:
            with guard():
                transport.get(dst, publisher, timeout=left).wait()
                transport.get(seq, publisher, seq_region, timeout=left).wait()
            if int(seq[0]) == first and int(seq[1]) == version:  # nothing changed meanwhile
                return version
        threading.Event().wait(delay if left is None else min(delay, left))  # mid-step
        delay = min(delay * 2, 0.05)
