"""What every version of a chaos run holds, computable by anyone: the trainer writes it and each
generator checks what it applied against it, element by element, bit for bit, without being
told the bytes.

Element ``i`` of tensor ``k`` at version ``n`` is the int32 bit pattern ``base + (n + phase) //
every`` (``base`` and ``phase`` hashes of ``i`` and ``k``; ``base`` keeps the float32 it spells
normal, never a NaN): each version changes ``1 / every`` of the elements, so a delta carries a
few percent of a version, as between two RL steps.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

#: an element changes every this many versions
EVERY = 50


class Content:
    """The tensors of every version: ``tensors`` of ``numel`` float32 elements. It owns the
    per-element hashes (two int32 tensors per tensor) and nothing else; not thread-safe (one
    scratch tensor)."""

    def __init__(self, tensors: int, numel: int) -> None:
        self.tensors, self.numel = tensors, numel
        self.base: list[torch.Tensor] = []
        self.phase: list[torch.Tensor] = []
        for k in range(tensors):
            h = (torch.arange(numel, dtype=torch.int64) * 2654435761 + k * 40503) & 0xFFFFFFFF
            self.base.append((((h >> 4) & 0xFFFFFFF) + (1 << 24)).to(torch.int32))
            self.phase.append(((h >> 11) % EVERY).to(torch.int32))
        self._scratch = torch.empty(numel, dtype=torch.int32)

    def names(self) -> list[str]:
        return [f"layers.{k}.w" for k in range(self.tensors)]

    def empty(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(self.numel) for name in self.names()}

    def write(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Fill ``tensors`` (as :meth:`empty` makes them) with ``version``."""
        for k, name in enumerate(self.names()):
            self._fill(k, version, tensors[name].view(torch.int32))

    def _fill(self, k: int, version: int, out: torch.Tensor) -> torch.Tensor:
        torch.add(self.phase[k], version, out=out)
        return out.div_(EVERY, rounding_mode="floor").add_(self.base[k])

    def mismatches(self, version: int, tensors: dict[str, torch.Tensor]) -> int:
        """Elements of ``tensors`` that differ from ``version`` (0: every bit is right)."""
        bad = 0
        for k, name in enumerate(self.names()):
            live = tensors[name].view(torch.int32)
            expected = self._fill(k, version, self._scratch)
            if not torch.equal(expected, live):
                bad += int(expected.ne(live).sum())
        return bad

    def which(
        self, version: int, tensors: dict[str, torch.Tensor], span: int = 8
    ) -> dict[str, Any]:
        """For a version that does not match: per tensor that differs, the version within
        ``span`` of ``version`` it holds whole, or how many of its elements are wrong, the span
        they lie in and what that span holds (another version, zeros): what a torn version is
        made of."""
        out: dict[str, Any] = {}
        for k, name in enumerate(self.names()):
            live = tensors[name].view(torch.int32)
            if torch.equal(self._fill(k, version, self._scratch), live):
                continue
            wrong = self._scratch.ne(live).nonzero().flatten()
            first, last = int(wrong[0]), int(wrong[-1])
            out[name] = f"{wrong.numel()} wrong in [{first}, {last}]"
            for other in range(max(0, version - span), version + span + 1):
                held = self._fill(k, other, self._scratch)
                if torch.equal(held, live):
                    out[name] = f"version {other}"
                    break
                if torch.equal(held[first : last + 1], live[first : last + 1]):
                    out[name] += f", version {other} there"
                    break
            else:
                if not bool(live[wrong].any()):
                    out[name] += ", zeros there"
        return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A short digest of every byte of ``tensors`` (in name order)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
