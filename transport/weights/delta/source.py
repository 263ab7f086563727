"""The trainer's side of delta updates: the bytes it published last, and each version's changes."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from transport.weights.delta.codec import DeltaLayout, Encoded, encode
from transport.weights.delta.policy import DeltaPolicy
from transport.weights.layouts import flat_like

#: ``delta=`` values a publisher takes
MODES = (False, True, "auto")
#: a version whose changes take more than this share of its bytes travels whole
MAX_SHARE = 0.5


def check_delta(delta: object) -> bool | str:
    if not (isinstance(delta, bool) or delta == "auto"):
        raise ValueError(f"delta must be True, False or 'auto', got {delta!r}")
    return delta  # type: ignore[return-value]


class DeltaSource:
    """Owns a copy of the tensors as last published (one flat buffer per device, where the
    tensors live: the memory of the model once more), the changes of the newest version against
    the one before it, and the outbox they are written from (registered once, grown as needed).

    Rules: :meth:`diff` runs once per version, in order, before any byte of that version moves;
    it compares the tensors with the copy (bit for bit), encodes the changes and brings the copy
    up to date, so that the copy always holds the version diffed last. A version whose changes
    exceed ``MAX_SHARE`` of its bytes has no delta (it travels whole). The first version has
    no base: it travels whole and becomes the base of the next. With ``auto``, :meth:`stage`
    diffs only when its :class:`DeltaPolicy` wants it. The outbox a write may still
    read is never overwritten (a new one is taken). A subscriber takes the changes only if it
    holds their base, takes every tensor and its inbox has room (:meth:`changes_for`).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], auto: bool = False) -> None:
        self.policy = DeltaPolicy(auto)
        self.names = tuple(sorted(tensors))
        self.layout = DeltaLayout({n: tensors[n] for n in self.names})
        self.limit = int(self.layout.nbytes * MAX_SHARE)
        self._copy: dict[str, torch.Tensor] | None = None
        self.base = -1  # the version the copy holds
        self.encoded: Encoded | None = None  # the newest version's changes, in the outbox
        self._outbox = Outbox()

    def stage(self, version: int, tensors: Mapping[str, torch.Tensor], in_use: bool) -> None:
        """At each publish: diff ``version`` if the policy wants it (else drop the copy), and
        tell the policy what the diff took."""
        if not self.policy.want_diff():
            self.drop()
            return
        started = time.monotonic()
        if self.diff(version, tensors, in_use) is not None:
            self.policy.diffed(time.monotonic() - started)

    def diff(
        self, version: int, tensors: Mapping[str, torch.Tensor], in_use: bool
    ) -> Encoded | None:
        """``version``'s changes against the version diffed before, placed in the outbox (None:
        it has none to send: the first version, or too many changes). The copy holds
        ``version`` after. ``in_use``: a write may still read the outbox."""
        current = {n: tensors[n] for n in self.names}
        enc = None
        if self._copy is None or self.base >= version:
            self._copy = flat_like(current)
            for n, t in current.items():
                self._copy[n].copy_(t)
        else:
            enc = encode(self.layout, current, self._copy, version, self.base, self.limit)
        self.base = version
        self.encoded = None if enc is None else self._outbox.place(enc, in_use)
        return self.encoded

    def drop(self) -> None:
        """Stop keeping the copy (its memory goes): the next :meth:`diff` takes it afresh."""
        self._copy = None
        self.encoded = None
        self.base = -1

    def changes_for(self, version: int, holds: int, inbox: int, names: int) -> Encoded | None:
        """``version``'s changes for a subscriber that holds version ``holds`` whole, has an
        inbox of ``inbox`` bytes and takes ``names`` tensors; None: it takes the version whole."""
        enc = self.encoded
        if (
            enc is None
            or enc.version != version
            or holds != enc.base
            or inbox < enc.blob.numel()
            or names != len(self.names)
        ):
            return None
        return enc


class Outbox:
    """Owns the buffer a version's changes are written from (registered once by the first
    write, grown as needed). Rule: a buffer a write may still read is never overwritten: a new
    one is taken (the old one goes once nothing refers to it)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def place(self, enc: Encoded, in_use: bool) -> Encoded:
        """``enc`` with its blob copied into the outbox; ``in_use``: a write may read it."""
        n, out = enc.blob.numel(), self._buffer
        if in_use or out.numel() < n or out.device != enc.blob.device:
            out = torch.empty(max(n, 2 * out.numel()), dtype=torch.uint8, device=enc.blob.device)
            self._buffer = out
        out[:n].copy_(enc.blob)
        return Encoded(enc.version, enc.base, out[:n], enc.changed, enc.elements)
