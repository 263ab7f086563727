"""The sequence word a publisher exposes beside its tensors, so that a late joiner's read of them
is never a half-updated state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
        self.updating = False

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """The trainer changes the tensors inside: odd, with no version, until the block ends."""
        if self.updating:
            raise RuntimeError("updating() is already active")
        self.updating = True
        self.word[0] += 1  # odd: changing
        self.word[1] = -1  # the new state has no version until publish() names it
        try:
            yield
        finally:
            self.word[0] += 1  # even: stable
            self.updating = False

    @contextlib.contextmanager
    def filling(self) -> Iterator[None]:
        """The publisher's packed copies take the tensors' values inside (odd meanwhile)."""
        odd = 0 if self.updating else 1
        self.word[0] += odd
        try:
            yield
        finally:
            self.word[0] += odd

    def stamp(self, version: int) -> None:
        """Name the stable state ``version`` for pull() (not while it changes)."""
        if not self.updating and int(self.word[0]) % 2 == 0:
            self.word[1] = version
