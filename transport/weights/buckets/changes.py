"""Delta buckets: a bucket's pieces as their changes against the copies both sides keep of them.

With ``delta`` on every engine of an update, each side keeps a copy of the pieces it sent (a
trainer rank: the buckets it fills) or received (a rollout worker: every bucket), named by the
update they hold (``token``). When every engine holds the same update (the plan's ``base``, see
topology.py), a trainer rank sends each bucket as the changes of its pieces against its copies
(weights/delta/: the same blob, rules and application as a weight group's), unless they would
take more than ``MAX_SHARE`` (half) of the bucket's data, a weight group's limit too; the
rollout worker applies them onto its copies and yields the tensors from those, bit for bit what
the bucket would have held raw.
"""

from __future__ import annotations

import torch

from transport import DeltaError, WireFormatError
from transport.weights.buckets.buckets import DTYPES, BucketPiece
from transport.weights.delta.codec import ChangeSet, DeltaLayout
from transport.weights.delta.decoder import patch
from transport.weights.delta.source import MAX_SHARE

#: the codec's version and base of a bucket's changes: the update's tokens say which they are
_VERSION, _BASE = 1, 0


def _dtype(p: BucketPiece) -> torch.dtype:
    """The dtype a piece is compared in: its own where its bytes are whole elements."""
    dt = DTYPES[p.dtype]
    size = dt.itemsize
    return dt if p.nbytes % size == 0 and p.chunk_at % size == 0 else torch.uint8


def _key(i: int, p: BucketPiece) -> str:
    return f"{i:07d}:{p.name}@{p.chunk_at}"  # in the bucket's order, and naming the tensor


def layout_of(pieces: list[BucketPiece]) -> DeltaLayout:
    """The codec's layout of a bucket: its pieces in order, each as elements of its dtype."""
    meta = {}
    for i, p in enumerate(pieces):
        dt = _dtype(p)
        meta[_key(i, p)] = torch.empty(p.nbytes // dt.itemsize, dtype=dt, device="meta")
    return DeltaLayout(meta)


class PieceCopies:
    """Owns one engine's copies of the pieces it sent or received (by tensor name and the
    chunk's first byte, on its buckets' device) and ``token``, the update they all hold ("":
    none whole). Rules: :meth:`begin` clears the token (an update that fails leaves none);
    :meth:`end` sets it and drops every copy the update did not touch, so that no copy older
    than the token is ever compared against; copies of the wrong size are no copies."""

    def __init__(self) -> None:
        self.copies: dict[tuple[str, int], torch.Tensor] = {}
        self.token = ""
        self._touched: set[tuple[str, int]] = set()

    def begin(self) -> str:
        """A new update: the token the copies held (their base), cleared until :meth:`end`."""
        held, self.token = self.token, ""
        self._touched = set()
        return held

    def drop(self) -> None:
        """Let go of every copy (``delta="auto"`` resting): the next update that keeps copies
        sends raw and takes them again."""
        self.copies.clear()
        self.token = ""
        self._touched = set()

    def end(self, token: str) -> None:
        for key in [k for k in self.copies if k not in self._touched]:
            del self.copies[key]
        self.token = token

    def _copy(self, p: BucketPiece) -> torch.Tensor | None:
        got = self.copies.get((p.name, p.chunk_at))
        return got if got is not None and got.numel() == p.nbytes else None

    def store(self, pieces: list[BucketPiece], data: torch.Tensor) -> None:
        """Keep the bytes of ``pieces`` as they lie in ``data`` (a bucket's data, uint8)."""
        for p in pieces:
            src = data[p.offset : p.offset + p.nbytes]
            old = self._copy(p)
            if old is None:
                self.copies[(p.name, p.chunk_at)] = src.clone()
            else:
                old.copy_(src)
            self._touched.add((p.name, p.chunk_at))

    def encode(self, pieces: list[BucketPiece], data: torch.Tensor) -> torch.Tensor | None:
        """The changes of ``pieces`` (in ``data``) against the copies, which then hold them;
        None when a piece has no copy or the changes exceed ``MAX_SHARE`` of the data (the copies are
        brought up to date all the same: the bucket goes raw)."""
        olds = [self._copy(p) for p in pieces]
        if any(o is None for o in olds):
            self.store(pieces, data)
            return None
        found = ChangeSet(layout_of(pieces))
        for i, (p, old) in enumerate(zip(pieces, olds, strict=True)):
            assert old is not None
            dt = _dtype(p)
            cur = data[p.offset : p.offset + p.nbytes].view(dt)
            found.compare(_key(i, p), 0, cur, old.view(dt))
            self._touched.add((p.name, p.chunk_at))
        enc = found.encode(_VERSION, _BASE, limit=int(sum(p.nbytes for p in pieces) * MAX_SHARE))
        return None if enc is None else enc.blob

    def apply(self, pieces: list[BucketPiece], blob: torch.Tensor, out: torch.Tensor) -> None:
        """Apply a bucket's changes onto the copies and lay the pieces out in ``out`` (uint8, as
        the bucket's data would have held them raw). WireFormatError (nothing written) when a
        piece has no copy here or the changes break a rule of their format."""
        olds = [self._copy(p) for p in pieces]
        missing = [p.name for p, o in zip(pieces, olds, strict=True) if o is None]
        if missing:
            raise WireFormatError(
                f"a bucket came as changes to tensors this worker holds no copy of: {missing[:3]}"
            )
        targets = {}
        for i, (p, old) in enumerate(zip(pieces, olds, strict=True)):
            assert old is not None
            targets[_key(i, p)] = old.view(_dtype(p))
        try:
            patch(layout_of(pieces), blob, _VERSION, _BASE, targets)
        except DeltaError as e:
            raise WireFormatError(f"a bucket's changes: {e}") from e
        self._touched.update((p.name, p.chunk_at) for p in pieces)
        for p, old in zip(pieces, olds, strict=True):
            assert old is not None
            out[p.offset : p.offset + p.nbytes].copy_(old)
