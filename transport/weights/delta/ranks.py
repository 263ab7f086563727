"""A sharded trainer's rank side of delta updates: per subscriber layout, the bytes this rank
last wrote there (after conversion) and each version's changes of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import torch

from transport.weights.delta.codec import ChangeSet, DeltaLayout, Encoded
from transport.weights.delta.policy import DeltaPolicy
from transport.weights.delta.source import MAX_SHARE, Outbox
from transport.weights.layouts import DestTensor
from transport.weights.publishing.write_plan import Item, SlotWrites

#: plans a slot's writes into the given pool, naming each destination tensor by its own name
Planner = Callable[[Sequence[torch.Tensor]], SlotWrites]


class _LayoutDelta:
    """One subscriber layout: what this rank writes there, planned through the scratch buffer
    (so that diffing never touches the pool that writes use), the copy of those bytes as last
    published, and the newest version's changes."""

    def __init__(self, dest: Mapping[str, DestTensor], writes: SlotWrites) -> None:
        meta = {
            n: torch.empty(tuple(dest[n].shape), dtype=dest[n].dtype, device="meta")
            for n in sorted(dest)
        }
        self.layout = DeltaLayout(meta)  # as the subscriber sees its tensors: the same digest
        self.writes = writes
        items = list(writes.direct_items) + [i for c in writes.chunks for i in c.items]
        device = items[0][1].device if items else torch.device("cpu")
        sizes = [-(-t.nbytes // 8) * 8 for _, t, _ in items]
        self.nbytes = sum(t.nbytes for _, t, _ in items)
        self.limit = int(self.nbytes * MAX_SHARE)
        self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self.copies: list[torch.Tensor] = []  # per item, in the order above
        at = 0
        for (_, t, _), n in zip(items, sizes, strict=True):
            self.copies.append(self.buffer[at : at + t.nbytes].view(t.dtype))
            at += n
        self.base = -1  # the version the copy holds (-1: none)
        self.encoded: Encoded | None = None
        self.outbox = Outbox()

    def _each(self) -> Iterable[tuple[Item, torch.Tensor]]:
        """Every item with its copy, the converted ones converted (chunk by chunk)."""
        k = 0
        for item in self.writes.direct_items:
            yield item, self.copies[k]
            k += 1
        for chunk in self.writes.chunks:
            for fill in chunk.fill:
                fill()
            for item in chunk.items:
                yield item, self.copies[k]
                k += 1

    def diff(self, version: int, in_use: bool) -> Encoded | None:
        if self.base < 0 or self.base >= version:
            for (_, t, _), copy in self._each():
                copy.copy_(t.reshape(-1).view(copy.dtype))
            enc = None
        else:
            found = ChangeSet(self.layout)
            for (name, t, offset), copy in self._each():
                found.compare(name, offset, t.reshape(-1), copy)
            enc = found.encode(version, self.base, self.limit)
        self.base = version
        self.encoded = None if enc is None else self.outbox.place(enc, in_use)
        return self.encoded


class RankDeltas:
    """Owns a sharded trainer rank's delta state: per subscriber layout it writes (subscribers
    of one layout share it; keyed by their declared layout), a copy of the bytes it wrote there
    as last published, converted as the subscriber takes them (bf16, fp8 with its scales: the
    delta is of the converted bytes, so it applies onto exactly what a whole write leaves),
    the scratch buffer conversions for the diff go through, and the policy of ``auto``.

    Memory: the bytes this rank writes to each distinct layout, once (for a TP=2 generator
    whose two workers take half the model each, one model's worth of destination bytes in all),
    plus one chunk of scratch. Rules: :meth:`diff` runs once per version, before any byte of it
    moves; a layout no member uses any more is dropped with its copy; a version whose changes
    at a layout exceed ``MAX_SHARE`` of this rank's bytes there travels whole there."""

    def __init__(self, device: torch.device, chunk_bytes: int, auto: bool) -> None:
        self.policy = DeltaPolicy(auto)
        self._scratch = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device)]
        self._layouts: dict[Hashable, _LayoutDelta] = {}

    def plan(self, key: Hashable, dest: Mapping[str, DestTensor], planner: Planner) -> None:
        """Know layout ``key`` (made by ``dest``), planning its writes with ``planner``."""
        if key not in self._layouts:
            self._layouts[key] = _LayoutDelta(dest, planner(self._scratch))

    def stage(self, version: int, keys: set[Hashable], in_use: bool) -> None:
        """At each publish: diff ``version`` at the layouts ``keys`` if the policy wants it (the
        others are dropped)."""
        for key in [k for k in self._layouts if k not in keys]:
            del self._layouts[key]
        if not self.policy.want_diff():
            for d in self._layouts.values():
                d.base, d.encoded = -1, None
            return
        started = time.monotonic()
        for key in keys:
            if key in self._layouts:
                self._layouts[key].diff(version, in_use)
        self.policy.diffed(time.monotonic() - started)

    def changes_for(self, key: Hashable, version: int, holds: int, room: int) -> Encoded | None:
        """``version``'s changes at layout ``key`` for a slot holding version ``holds`` whole,
        with ``room`` bytes of inbox for this rank; None: the version goes whole."""
        d = self._layouts.get(key)
        enc = None if d is None or not d.nbytes else d.encoded  # nothing to write: no changes
        if enc is None or enc.version != version or enc.base != holds:
            return None
        return enc if enc.blob.numel() <= room else None
