"""A trainer rank's side of one update: pack the stream into buckets, write the ones it owns.

Every rank consumes the whole stream (verl's FSDP engine gathers each full tensor on every rank,
a collective all ranks must join) and packs it the same way (:class:`~.buckets.Packer`); rank
``r`` of ``W`` copies and sends buckets ``r, r + W, r + 2W, ...``. Bucket ``k`` goes into slot
``k % 2`` of every target once that target freed the slot (its ``Free(k)``, after it yielded and
relayed bucket ``k - 2``), as one put per target whose notification is the bucket's
:class:`~.messages.Bucket` message. While those puts fly, the rank goes on with the stream: it
fills its other send buffer (one rank alone has two), or, with several ranks, skips the others'
buckets.

A target that dies, freezes or aborts is dropped (with its reason) and the others complete; an
``Abort(whole=True)`` (a receiver found another trainer rank gone) fails this rank's update with
that reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch

from transport import Handle, Transport
from transport.errors import TransportError
from transport.integrations.verl.buckets import Packer, Planned
from transport.integrations.verl.inbox import Inbox, PeerGone
from transport.integrations.verl.messages import CHANNEL, MAX_REASON, Abort, Bucket, encode
from transport.integrations.verl.topology import UpdatePlan

log = logging.getLogger("transport.verl")

#: the region of a rollout worker that holds its two bucket slots
SLOTS = "verl.slots"


class UpdateAborted(TransportError):
    """The update cannot complete: a worker it depends on is gone, or another said so."""


@dataclass
class SendReport:
    """What one trainer rank did in one update."""

    buckets: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    dropped: dict[str, str] = field(default_factory=dict)

    def metrics(self, rank: int) -> dict[str, float]:
        return {
            f"transport/rank{rank}/buckets_sent": float(self.buckets),
            f"transport/rank{rank}/bytes_sent": float(self.bytes_sent),
            f"transport/rank{rank}/send_s": self.seconds,
            f"transport/rank{rank}/dropped": float(len(self.dropped)),
        }


async def aiter_of(weights: object) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """verl's weights as an async iterator (it hands either kind)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:  # type: ignore[attr-defined]
            yield item
    else:
        for item in weights:  # type: ignore[attr-defined]
            yield item


class BucketSender:
    """One trainer rank's update. It owns nothing but the update's bookkeeping: the send buffers
    (registered uint8 tensors, one or two) and the Transport are the engine's."""

    def __init__(
        self,
        transport: Transport,
        inbox: Inbox,
        plan: UpdatePlan,
        buffers: list[torch.Tensor],
        timeout: float,
    ) -> None:
        self.transport = transport
        self.inbox = inbox
        self.plan = plan
        self.buffers = buffers
        self.timeout = timeout
        self.targets = list(plan.targets)
        self.report = SendReport()
        self._flying: list[list[tuple[str, Handle]]] = [[] for _ in buffers]
        self._filling: list[int] = [-1 for _ in buffers]
        self._aborts_seen = 0

    def _buffer_of(self, index: int) -> int:
        return (index // len(self.plan.trainers)) % len(self.buffers)

    def drop(self, peer: str, why: str) -> None:
        if peer in self.targets:
            self.targets.remove(peer)
            self.report.dropped[peer] = why
            log.warning(
                "update %s: rank %d drops %s: %s", self.plan.token, self.plan.rank, peer, why
            )

    async def _land(self, b: int) -> None:
        """Wait for the puts from buffer ``b``; a target whose put failed is dropped."""
        for peer, handle in self._flying[b]:
            try:
                await handle
            except TransportError as e:
                self.drop(peer, f"its bucket put failed ({type(e).__name__}: {e})")
        self._flying[b] = []

    def _aborts(self) -> None:
        """Drop each target that aborted; raise if one says the whole update is lost."""
        for peer, abort in self.inbox.aborts[self._aborts_seen :]:
            self._aborts_seen += 1
            if abort.whole:
                raise UpdateAborted(f"{peer} aborted the update: {abort.reason}")
            self.drop(peer, f"it aborted the update: {abort.reason}")

    async def _credits(self, index: int) -> None:
        """Wait until every target freed its slot for bucket ``index``."""
        while True:
            self._aborts()
            waiting = [p for p in self.targets if not self.inbox.may_write(p, index)]
            if not waiting:
                return
            try:
                await asyncio.to_thread(
                    self.inbox.wait, partial(self._freed, waiting, index),
                    watch=partial(list, waiting), timeout=self.timeout,
                    what=f"a free slot for bucket {index} at {', '.join(waiting)}",
                )  # fmt: skip
            except PeerGone as e:
                self.drop(e.peer, e.why)
            except TransportError as e:
                for peer in waiting:
                    if not self.inbox.may_write(peer, index):
                        self.drop(peer, str(e))

    def _freed(self, waiting: list[str], index: int) -> bool | None:
        """(under the inbox's lock) whether the wait for ``waiting`` is over: all freed their
        slot, or a new abort came."""
        if len(self.inbox.aborts) > self._aborts_seen:
            return True
        return True if all(self.inbox.may_write(p, index) for p in waiting) else None

    async def _ship(self, planned: Planned, last: bool) -> None:
        if not self.plan.sends(planned.index):
            return
        b = self._buffer_of(planned.index)
        buf = self.buffers[b]
        if self._filling[b] != planned.index:  # an empty bucket: nothing was copied into it
            await self._land(b)
            self._filling[b] = planned.index
        at = planned.header_at
        buf[at : at + len(planned.header)].copy_(
            torch.frombuffer(bytearray(planned.header), dtype=torch.uint8)
        )
        await self._credits(planned.index)
        slot = planned.index % 2
        msg = encode(Bucket(self.plan.token, planned.index, slot, planned.data_bytes, at,
                            len(planned.header), last))  # fmt: skip
        src = buf[: planned.nbytes]
        if src.is_cuda:  # the copies into it were queued on the current stream
            torch.cuda.current_stream(src.device).synchronize()
        core = self.transport.core
        for peer in list(self.targets):
            try:
                handle = core.put_control_at(src, SLOTS, slot * self.plan.bucket_bytes, peer,
                                             CHANNEL, msg, self.timeout)  # fmt: skip
            except TransportError as e:
                self.drop(peer, f"its bucket put failed ({type(e).__name__}: {e})")
                continue
            self._flying[b].append((peer, handle))
        self.report.buckets += 1
        self.report.bytes_sent += planned.nbytes * len(self._flying[b])

    async def _buffer_for(self, index: int) -> torch.Tensor:
        b = self._buffer_of(index)
        if self._filling[b] != index:
            await self._land(b)  # its previous bucket must have left before it is refilled
            self._filling[b] = index
        return self.buffers[b]

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]] | object) -> SendReport:
        """Pack ``weights``, ship this rank's buckets, wait until they landed. On any failure
        every target is told (``Abort``, whole: the update cannot complete) before it raises."""
        start = time.perf_counter()
        try:
            await self._send(weights)
        except BaseException as e:
            why = f"trainer rank {self.plan.rank} ({self.transport.name}) failed: {type(e).__name__}: {e}"
            abort = encode(Abort(self.plan.token, why[:MAX_REASON], True))
            for peer in self.targets:
                try:
                    self.transport.core.send_control(peer, CHANNEL, abort)
                except TransportError as err:
                    log.info(
                        "could not tell %s that update %s stopped: %s", peer, self.plan.token, err
                    )
            raise
        self.report.seconds = time.perf_counter() - start
        return self.report

    async def _send(self, weights: Iterable[tuple[str, torch.Tensor]] | object) -> None:
        packer = Packer(self.plan.bucket_bytes)
        async for name, tensor in aiter_of(weights):
            for item in packer.add(name, tensor):
                if isinstance(item, Planned):
                    await self._ship(item, last=False)
                    continue
                piece, data = item
                if self.plan.sends(packer.index) and piece.nbytes:
                    buf = await self._buffer_for(packer.index)
                    buf[piece.offset : piece.offset + piece.nbytes].copy_(data, non_blocking=True)
        await self._ship(packer.finish(), last=True)
        for b in range(len(self.buffers)):
            await self._land(b)
        self._aborts()
