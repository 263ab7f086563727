"""A trainer rank's side of one update: pack the stream into buckets, write the ones it owns.

Every rank consumes the whole stream (verl's FSDP engine gathers each full tensor on every rank,
a collective all ranks must join) and packs it the same way (:class:`~.buckets.Packer`); rank
``r`` of ``W`` copies and sends buckets ``r, r + W, r + 2W, ...``. Bucket ``k`` goes into slot
``k % 2`` of every target once that target freed the slot (its ``Free(k)``, after it yielded and
relayed bucket ``k - 2``), as one put per target whose notification is the bucket's
:class:`~.messages.Bucket` message. While those puts fly, the rank goes on with the stream: it
fills its other send buffer (one rank alone has two), or, with several ranks, skips the others'
buckets.

A target that dies, freezes or stops is dropped (with its reason) and the others complete; an
``Stop(whole=True)`` (a receiver found another trainer rank gone) fails this rank's update with
that reason. When the engine begins another update before this one ended, this one stops at its
next step (after every await it checks that it is still the engine's update: inbox.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import torch

from transport import Handle, Transport, UpdateAbortedError
from transport.weights.buckets.buckets import Packer, Planned, aligned
from transport.weights.buckets.changes import PieceCopies
from transport.weights.buckets.inbox import Inbox
from transport.weights.buckets.messages import MAX_REASON, Bucket, Stop
from transport.weights.buckets.targets import Targets, tell
from transport.weights.buckets.topology import UpdatePlan
from transport.weights.delta.policy import DeltaPolicy


@dataclass
class SendReport:
    """What one trainer rank did in one update."""

    buckets: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    dropped: dict[str, str] = field(default_factory=dict)
    as_changes: int = 0  # buckets sent as their changes
    source_s: float = 0.0  # of ``seconds``, waiting for the trainer's stream of tensors
    diffing: bool = False  # whether this rank kept copies to diff against (delta)

    def metrics(self, rank: int) -> dict[str, float]:
        return {
            f"transport/rank{rank}/buckets_sent": float(self.buckets),
            f"transport/rank{rank}/buckets_as_changes": float(self.as_changes),
            f"transport/rank{rank}/bytes_sent": float(self.bytes_sent),
            f"transport/rank{rank}/send_s": self.seconds,
            f"transport/rank{rank}/source_s": self.source_s,
            f"transport/rank{rank}/delta_diffing": float(self.diffing),
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
    (registered uint8 tensors, one or two), the copies of what it sent (``copies``, with delta:
    changes.py), the ``delta="auto"`` policy (``policy``, weights/delta/policy.py) and the
    Transport are the engine's.

    With a policy, each update asks it once whether to diff: while it rests, the rank lets go
    of its copies and sends raw (so the job's next update goes raw everywhere, and the one
    after may diff again); after each update it tells the policy what the update cost this
    rank beyond waiting for the trainer's stream, as changes or raw."""

    def __init__(
        self,
        transport: Transport,
        inbox: Inbox,
        plan: UpdatePlan,
        buffers: list[torch.Tensor],
        timeout: float,
        copies: PieceCopies | None = None,
        policy: DeltaPolicy | None = None,
    ) -> None:
        self.transport = transport
        self.plan = plan
        self.buffers = buffers
        self.policy = policy
        if copies is not None and policy is not None and not policy.want_diff():
            copies.drop()  # resting: no copies, no cost
            copies = None
        self.copies = copies
        self.base = copies.begin() if copies is not None else ""
        self._encode_s = 0.0
        who = f"update {plan.token}: rank {plan.rank}"
        self.targets = Targets(transport, inbox, plan.token, plan.targets, timeout, who)
        self.report = SendReport(dropped=self.targets.dropped, diffing=copies is not None)
        self._flying: list[list[tuple[str, Handle]]] = [[] for _ in buffers]
        self._filling: list[int] = [-1 for _ in buffers]

    def _stops(self) -> None:
        """Read the new stops; raise if one says that the whole update is lost."""
        self.targets.take_stops()
        if self.targets.whole is not None:
            peer, stop = self.targets.whole
            raise UpdateAbortedError(f"{peer} aborted the update: {stop.reason}")

    def _live(self) -> None:
        """UpdateSupersededError when the engine began another update (called after every await:
        the buffers and the copies are the next update's from then on)."""
        self.targets.inbox.check(self.plan.token)

    def _buffer_of(self, index: int) -> int:
        return (index // len(self.plan.trainers)) % len(self.buffers)

    async def _buffer_for(self, index: int) -> torch.Tensor:
        """The send buffer of bucket ``index``, its previous bucket's puts landed."""
        b = self._buffer_of(index)
        if self._filling[b] != index:
            await self.targets.land(self._flying[b])
            self._live()
            self._flying[b] = []
            self._filling[b] = index
        return self.buffers[b]

    async def _ship(self, planned: Planned, last: bool) -> None:
        if not self.plan.sends(planned.index):
            return
        buf = await self._buffer_for(planned.index)
        at, changes = planned.header_at, 0
        if self.copies is not None:
            data = buf[: planned.data_bytes]
            blob = None
            if self.plan.base and self.base == self.plan.base:
                started = time.perf_counter()
                blob = self.copies.encode(planned.pieces, data)
                self._encode_s += time.perf_counter() - started
            else:
                self.copies.store(planned.pieces, data)
            if blob is not None:  # the changes in place of the data, the header after them
                changes = blob.numel()
                buf[:changes].copy_(blob)
                at = aligned(changes)
                self.report.as_changes += 1
        buf[at : at + len(planned.header)].copy_(
            torch.frombuffer(bytearray(planned.header), dtype=torch.uint8)
        )
        inbox = self.targets.inbox
        while not all(inbox.may_write(p, planned.index) for p in self.targets.peers):
            await self.targets.wait_free(planned.index)  # freed, dropped, or a stop came
            self._stops()
        src = buf[: at + len(planned.header)]
        if src.is_cuda:  # the copies into it were queued on the current stream
            torch.cuda.current_stream(src.device).synchronize()
        msg = Bucket(
            self.plan.token,
            planned.index,
            planned.index % 2,
            planned.data_bytes,
            at,
            len(planned.header),
            last,
            changes,
        )
        flying = self.targets.post(src, msg, self.plan.bucket_bytes)
        self._flying[self._buffer_of(planned.index)] += flying
        self.report.buckets += 1
        self.report.bytes_sent += src.numel() * len(flying)

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]] | object) -> SendReport:
        """Pack ``weights``, ship this rank's buckets, wait until they landed. On any failure
        every target is told (``Stop``, whole: the update cannot complete) before it raises."""
        start = time.perf_counter()
        try:
            await self._send(weights)
        except BaseException as e:
            why = f"trainer rank {self.plan.rank} ({self.transport.name}) failed: {type(e).__name__}: {e}"
            tell(self.transport, self.targets.peers, Stop(self.plan.token, why[:MAX_REASON], True))
            raise
        if self.copies is not None:  # they hold this update now
            self.copies.end(self.plan.token)
        self.report.seconds = time.perf_counter() - start
        self._judge()
        return self.report

    def _judge(self) -> None:
        """Tell the policy what this update cost this rank (the trainer's stream left out: it
        costs the same either way)."""
        if self.policy is None:
            return
        ours = max(0.0, self.report.seconds - self.report.source_s - self._encode_s)
        if self.report.as_changes:
            self.policy.diffed(self._encode_s)
        self.policy.wrote(self.report.as_changes > 0, ours)

    async def _stream(
        self, weights: Iterable[tuple[str, torch.Tensor]] | object
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """``weights``, timing the waits for each tensor (``report.source_s``)."""
        items = aiter_of(weights)
        while True:
            started = time.perf_counter()
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            finally:
                self.report.source_s += time.perf_counter() - started
            self._live()
            yield item

    async def _send(self, weights: Iterable[tuple[str, torch.Tensor]] | object) -> None:
        packer = Packer(self.plan.bucket_bytes)
        async for name, tensor in self._stream(weights):
            for item in packer.add(name, tensor):
                if isinstance(item, Planned):
                    await self._ship(item, last=False)
                    continue
                piece, data = item
                if self.plan.sends(packer.index) and piece.nbytes:
                    buf = await self._buffer_for(packer.index)
                    buf[piece.offset : piece.offset + piece.nbytes].copy_(data, non_blocking=True)
        await self._ship(packer.finish(), last=True)
        for flying in self._flying:
            await self.targets.land(flying)
        self._live()  # the copies are still this update's
        self._stops()
