"""Supersession, the one rule of both weight protocols for what a writer may still write: the
newest version or update it began is the only live one, and nothing of an older one is written
from then on (its source may already hold the newer bytes, and the reader's slots are the newer
one's).

* A weight publisher begins a version when a publish starts preparing it (the trainer's tensors
  may hold its bytes from then on): an older version still waiting for a member's slot is given
  up, and changes refused for an older version are not written whole.
* A verl engine begins an update at each ``init_process_group`` (the bucket stream,
  buckets/inbox.py): an older update still running on it stops at its next step, and its
  messages that arrive late are dropped.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")


class Supersession(Generic[K]):
    """The key (a version, an update's token) of the newest thing one writer began.

    Rules: :meth:`begin` makes a key the live one (its caller holds its own lock, and for
    ordered keys begins only a newer one); every other key is :meth:`superseded`, and so is
    every key before the first begin."""

    def __init__(self) -> None:
        self._live: K | None = None

    @property
    def live(self) -> K | None:
        """The key begun last (None: none yet)."""
        return self._live

    def begin(self, key: K) -> K | None:
        """Make ``key`` the live one; returns the one it supersedes (None: none)."""
        old, self._live = self._live, key
        return old

    def superseded(self, key: K) -> bool:
        """Whether ``key`` is no longer (or not) the live one."""
        return self._live is None or key != self._live
