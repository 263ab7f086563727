"""A staging subscriber's delta inbox: where a version's changes land, and how they become a slot."""

from __future__ import annotations

import torch

from transport import DeltaError
from transport.weights.delta.codec import DeltaLayout
from transport.weights.delta.decoder import patch
from transport.weights.layouts.flat import CopyRuns, copy_runs

#: the share of a subscriber's bytes its inbox holds when ``delta=True``: changes of up to
#: about a fifth of a bfloat16 model's elements (a version with more travels whole)
INBOX_SHARE = 0.25
#: the smallest inbox ``delta=True`` makes
MIN_INBOX = 1 << 20


def inbox_bytes(delta: object, nbytes: int) -> int:
    """The inbox a subscriber's ``delta=`` asks for (0: none), or ValueError / TypeError."""
    if delta is False:
        return 0
    if delta is True:
        return max(MIN_INBOX, int(nbytes * INBOX_SHARE))
    if not isinstance(delta, int) or isinstance(delta, bool):
        raise TypeError(f"delta is a bool or a size in bytes, got {type(delta).__name__}")
    if delta < 64:
        raise ValueError(f"delta (the inbox's size in bytes) must be at least 64, got {delta}")
    return delta


def delta_inbox(delta: object, staging: list[dict[str, torch.Tensor]]) -> DeltaInbox | None:
    """The inbox a subscriber's ``delta=`` asks for, or None; ValueError where it cannot have
    one."""
    nbytes = sum(t.numel() * t.element_size() for t in staging[0].values())
    size = inbox_bytes(delta, nbytes)
    return DeltaInbox(staging, size) if size else None


class DeltaInbox:
    """Owns the inbox (``buffer``, uint8, on the slots' device) that publishers write a
    version's changes into (each rank of a sharded trainer its own part), and applies them onto
    a slot holding their base, bit for bit; and makes a slot a copy of another (priming: a free
    slot then holds the newest version, which the next version's changes apply onto).

    Rules: the slots are a subscriber's staging copies (or, in place, its live tensors), all on
    one device; the changes are checked whole (weights/delta/decoder.py) before the slot is
    touched; the caller keeps the slots from every other writer meanwhile."""

    def __init__(self, slots: list[dict[str, torch.Tensor]], nbytes: int) -> None:
        first = slots[0]
        devices = {t.device for t in first.values()}
        if len(devices) != 1:
            raise ValueError(
                "delta needs the staging slots on one device (give staging_device=), "
                f"they are on {sorted(map(str, devices))}"
            )
        self.slots = slots
        self.layout = DeltaLayout({n: first[n] for n in sorted(first)})
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=devices.pop())
        self._copies: dict[tuple[int, int], CopyRuns] = {}  # (src, dst) -> its runs, made once

    def made(self, dst: int, version: int, base: int, at: int, nbytes: int) -> str:
        """:meth:`make`; "" when done, else why nothing was written."""
        try:
            self.make(dst, version, base, at, nbytes)
        except DeltaError as e:
            return str(e)
        return ""

    def make(self, dst: int, version: int, base: int, at: int, nbytes: int) -> None:
        """Apply the changes in the inbox's bytes ``at`` to ``at + nbytes - 1`` onto slot
        ``dst`` (holding ``base``; in place the live tensors). DeltaError (nothing written)
        when the changes break a rule or were made for other tensors or another base."""
        if at + nbytes > self.buffer.numel():
            raise DeltaError(
                f"delta: bytes {at} to {at + nbytes} announced, the inbox holds "
                f"{self.buffer.numel()}"
            )
        patch(self.layout, self.buffer[at : at + nbytes], version, base, self.slots[dst])

    def prime(self, src: int, dst: int) -> None:
        """Slot ``dst`` becomes a copy of slot ``src``."""
        runs = self._copies.get((src, dst))
        if runs is None:
            runs = self._copies[(src, dst)] = copy_runs(self.slots[dst], self.slots[src])
        runs.run()
