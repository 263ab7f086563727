"""A version cut into segments on its way to a relay: the cuts, and the write that posts them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from transport import TransferTimeout
from transport.weights.group.messages import Begin, PartLanded, Segment, Ver, encode
from transport.weights.group.region_names import channel, region, tell_newest

log = logging.getLogger(__name__)

#: the size of the segments a version is cut into on its way to a relay
SEGMENT_BYTES = 32 << 20


def pieces(t: torch.Tensor, seg_bytes: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """(byte offset, bytes) of the pieces a tensor larger than ``seg_bytes`` travels in, each a
    whole number of elements."""
    size = t.element_size()
    step = max(size, seg_bytes - seg_bytes % size)
    return [(o, min(step, t.nbytes - o)) for o in range(0, t.nbytes, step)]


def piece(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The elements of ``t`` (contiguous) at bytes ``offset`` to ``offset + nbytes - 1``."""
    size = t.element_size()
    return t.reshape(-1)[offset // size : (offset + nbytes) // size]


def segments(tensors: Mapping[str, torch.Tensor], seg_bytes: int = SEGMENT_BYTES) -> list[int]:
    """Where the segments of a relay's tensors (its names in sorted order) begin, and the end:
    consecutive tensors of at least ``seg_bytes`` together; a tensor larger than that is a
    segment of its own (it travels in ``pieces``)."""
    names = sorted(tensors)
    bounds, size = [0], 0
    for i, n in enumerate(names):
        nbytes = tensors[n].nbytes
        if nbytes > seg_bytes and size:
            bounds.append(i)
            size = 0
        size += nbytes
        if size >= seg_bytes and i + 1 < len(names):
            bounds.append(i + 1)
            size = 0
    bounds.append(len(names))
    return bounds


@dataclass(frozen=True)
class SegmentBatch:
    """One segment of a peer's tensors (in sorted order of their names) for one of its slots:
    the indexes ``first`` to ``end - 1``, and its batch (the peer's region names as keys)."""

    first: int
    end: int
    batch: dict[str, torch.Tensor]


def segment_batches(
    tensors: Mapping[str, torch.Tensor], group: str, slot: int, seg_bytes: int = SEGMENT_BYTES
) -> list[SegmentBatch]:
    """The segments of ``tensors`` (a peer's names in sorted order) for its ``slot``."""
    names = sorted(tensors)
    bounds = segments(tensors, seg_bytes)
    return [
        SegmentBatch(a, b, {region(group, slot, n): tensors[n] for n in names[a:b]})
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def piece_bytes(transport: Any, seg_bytes: int) -> int:
    """How large the pieces of a tensor over ``seg_bytes`` are: as large as the Transport cuts
    a transfer over its lanes, so that pipelining never costs the lanes."""
    return max(seg_bytes, transport.lane_bytes if transport.lanes > 1 else 0)


class SegmentedWrite:
    """Writes one version into one slot of a peer in segments, as they become ready: each
    segment is posted at once (announced by a ``seg`` message when the peer relays); the last one
    carries ``ver`` and is posted only once every other one has landed. ``done(error or None)``
    is called once, on ``submit``'s thread, when all of it has landed or the first error is known
    and nothing is in flight any more."""

    def __init__(
        self,
        transport: Any,
        peer: str,
        group: str,
        version: int,
        slot: int,
        deadline: float,
        announce: bool,
        submit: Callable[[Callable[[], Any]], None],
        done: Callable[[BaseException | None], Any],
    ) -> None:
        self.t, self.peer, self.group, self.chan = transport, peer, group, channel(group)
        self.version, self.slot, self.deadline, self.announce = version, slot, deadline, announce
        self.submit, self.done = submit, done
        self._lock = threading.Lock()
        self._pending = 0
        self._last: dict[str, torch.Tensor] | None = None
        self._ended = self._finished = False
        self.error: BaseException | None = None
        #: told of every transfer posted (a publisher keeps its version open while they read)
        self.track: Callable[[Any], None] | None = None

    def post(
        self,
        segs: list[SegmentBatch],
        segment_bytes: int,
        step: int,
    ) -> None:
        """Write every segment of ``segs`` (in order), a tensor larger than ``segment_bytes``
        alone in ``step``-byte pieces; the last one ends the write."""
        for i, seg in enumerate(segs):
            a, b, batch = seg.first, seg.end, seg.batch
            last = i == len(segs) - 1
            alone = next(iter(batch.items())) if b == a + 1 else None
            if alone is not None and alone[1].nbytes > segment_bytes:
                key, t = alone
                for offset, nbytes in pieces(t, step):  # a huge tensor: piece by piece
                    self.add_part(a, key, t, offset, nbytes)
                if last:
                    self.end({})
            elif not last:
                self.add(a, b, batch)
            else:
                self.end(batch)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"the deadline of version {self.version} passed")
        return left

    def begin(self, reconnect: bool = False) -> bool:
        """Announce the write (``begin``); False if that failed (the write then ends with the
        error). ``reconnect``: a peer found lost is looked up afresh and told once more, for a
        writer that was handed the peer's newest incarnation by whoever planned the write (a
        relay: the connection it holds may be to the incarnation before)."""
        msg = encode(Begin(self.version, self.slot))
        self.t.recorder.record(
            "ws-plan", op="write", peers=self.peer, info=f"v{self.version} slot {self.slot}"
        )
        try:
            if reconnect:
                tell_newest(self.t, self.peer, self.group, msg)
            else:
                self.t.core.send_control(self.peer, self.chan, msg)
        except Exception as e:
            self.fail(e)
            return False
        return True

    def add(self, a: int, b: int, batch: Mapping[str, torch.Tensor]) -> None:
        """Post the tensors ``a`` to ``b - 1`` (in the peer's sorted names) now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            if self.announce:
                msg = encode(Segment(self.version, self.slot, a, b))
                h = self.t.core.put_control(batch, self.peer, self.chan, msg, self._left())
            else:
                h = self.t.put(dict(batch), self.peer, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        if self.track is not None:
            self.track(h)
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def add_part(self, a: int, key: str, t: torch.Tensor, offset: int, nbytes: int) -> None:
        """Post bytes ``offset`` to ``offset + nbytes - 1`` of ``t`` (tensor ``a`` in the peer's
        sorted names) into the same bytes of the peer's region ``key`` now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            src, at = piece(t, offset, nbytes), offset // t.element_size()
            if self.announce:
                msg = encode(PartLanded(self.version, self.slot, a, offset, nbytes))
                h = self.t.core.put_control_at(
                    src, key, at, self.peer, self.chan, msg, self._left()
                )
            else:
                h = self.t.put(src, self.peer, key, offset=at, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        if self.track is not None:
            self.track(h)
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def end(self, last: Mapping[str, torch.Tensor]) -> None:
        """The rest (possibly nothing), with ``ver``, once every segment posted so far landed."""
        with self._lock:
            self._ended, self._last = True, dict(last)
        self._landed(None, count=False)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._ended = True
        self._landed(None, count=False)

    def _landed(self, error: BaseException | None, count: bool = True) -> None:
        with self._lock:
            if count:
                self._pending -= 1
            if error is not None and self.error is None:
                self.error = error
            if not self._ended or self._pending or self._finished:
                return
            self._finished = True
            last, err = self._last, self.error
        if err is None:
            try:
                msg = encode(Ver(self.version, self.slot))
                if last:
                    h = self.t.core.put_control(last, self.peer, self.chan, msg, self._left())
                    if self.track is not None:
                        self.track(h)
                    h.add_done_callback(lambda h: self.submit(lambda: self.done(h.exception(0))))
                    return
                self.t.core.send_control(self.peer, self.chan, msg)
            except Exception as e:
                err = e
        self.done(err)
