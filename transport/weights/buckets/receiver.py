"""A rollout worker's side of one update: take each bucket as it lands, relay it, yield its tensors.

The worker opens the update by freeing both slots (``Free(0)`` and ``Free(1)``), once every
peer that writes it in this update said it began it (``Begun``: none of its puts of an earlier
update can land any more; inbox.py). A peer that wrote this worker in an earlier update but
does not in this one (the plan changed) is not waited for; verl builds every update's plan from
the same engines in the same order, so a worker's writers stay the same. Bucket ``k`` comes from ``plan.sender_of(k)`` (a trainer
rank, or the parent relay) into slot ``k % 2``; the worker reads the bucket's header from its own memory, checks it
(:func:`~.buckets.read_header`), starts relaying the bucket to its children (each once it freed
its slot), and yields the bucket's tensors. When the caller asks for the tensor after the
bucket's last one and the relays have landed, the slot is free again: ``Free(k + 2)`` goes to the
sender of bucket ``k + 2``. Meanwhile bucket ``k + 1`` lands in the other slot.

Failure: the sender of the bucket awaited is gone (its heartbeat, seconds) -> the update fails
here, naming it, and every trainer rank and child is told (``Stop``; whole when a trainer rank
is gone). A child that dies is dropped and the others go on. Anything else that fails here
(a header that breaks a rule, a tensor that changed its shape) aborts this worker's update only.
When the engine begins another update before this one ended, this one stops at its next step
(after every await and every tensor it yielded it checks that it is still the engine's update:
inbox.py), so it never reads a slot or touches a copy of the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from functools import partial

import torch

from transport import (
    Handle,
    PeerGoneError,
    Transport,
    TransportError,
    UpdateAbortedError,
    WireFormatError,
)
from transport.weights.buckets.buckets import Assembler, read_header
from transport.weights.buckets.changes import PieceCopies
from transport.weights.buckets.inbox import Inbox
from transport.weights.buckets.messages import CHANNEL, MAX_REASON, Bucket, Free, Stop, encode
from transport.weights.buckets.targets import Targets, tell
from transport.weights.buckets.topology import UpdatePlan

log = logging.getLogger(__name__)


class BucketReceiver:
    """One rollout worker's update. It owns the update's bookkeeping; the slots (a registered,
    exposed uint8 tensor of two buckets), the Assembler (what names it has seen), the copies of
    what it received (``copies``, with delta: changes.py; a bucket that came as its changes is
    laid out raw in ``scratch``, one bucket) and the Transport are the engine's."""

    def __init__(
        self,
        transport: Transport,
        inbox: Inbox,
        plan: UpdatePlan,
        slots: torch.Tensor,
        assembler: Assembler,
        timeout: float,
        copies: PieceCopies | None = None,
        scratch: torch.Tensor | None = None,
    ) -> None:
        self.transport = transport
        self.inbox = inbox
        self.plan = plan
        self.slots = slots
        self.assembler = assembler
        self.timeout = timeout
        self.copies, self.scratch = copies, scratch
        self.base = copies.begin() if copies is not None else ""
        who = f"update {plan.token}: {transport.name}"
        self.children = Targets(transport, inbox, plan.token, plan.targets, timeout, who)
        self.buckets = 0

    def _live(self) -> None:
        """UpdateSupersededError when the engine began another update (called after every await and
        every tensor yielded: the slots and the copies are the next update's from then on)."""
        self.inbox.check(self.plan.token)

    def _slot(self, slot: int) -> torch.Tensor:
        b = self.plan.bucket_bytes
        return self.slots[slot * b : (slot + 1) * b]

    def _upstream_stop(self) -> Stop | None:
        """(under the inbox's lock) a stop from whoever this worker depends on: its parent, or
        a trainer rank's ``whole`` one (a trainer rank that failed tells its targets; a root
        relays nothing of it, its children see their parent stop)."""
        for peer, stop in self.inbox.stops:
            if peer == self.plan.parent or (stop.whole and peer in self.plan.trainers):
                return stop
        return None

    async def _open(self) -> None:
        """Wait until every writer of this worker began the update, then free both slots."""
        writers = self.plan.senders()

        def ready() -> bool | Stop | None:
            if all(p in self.inbox.begun for p in writers):
                return True
            return self._upstream_stop()

        got = await asyncio.to_thread(
            partial(
                self.inbox.wait,
                ready,
                watch=lambda: [p for p in writers if p not in self.inbox.begun],
                timeout=self.timeout,
                what=f"word that the update began at {', '.join(writers)}",
                token=self.plan.token,
            )
        )
        if isinstance(got, Stop):
            raise UpdateAbortedError(f"the update stopped before it began here: {got.reason}")
        self._live()
        for index in (0, 1):
            self._free(index)

    def _free(self, index: int) -> None:
        """Free slot ``index % 2`` for bucket ``index`` at its sender."""
        sender = self.plan.sender_of(index)
        try:
            self.transport.core.send_control(sender, CHANNEL, encode(Free(self.plan.token, index)))
        except TransportError as e:  # a gone sender is found while waiting for it
            log.info("could not free a slot at %s: %s", sender, e)

    async def _bucket(self, index: int) -> Bucket:
        sender = self.plan.sender_of(index)

        def ready() -> Bucket | Stop | None:
            got = self.inbox.buckets.get((sender, index))
            return got if got is not None else self._upstream_stop()

        got: Bucket | Stop = await asyncio.to_thread(  # type: ignore[assignment]
            partial(
                self.inbox.wait,
                ready,
                watch=lambda: [sender],
                timeout=self.timeout,  # type: ignore[arg-type]
                what=f"bucket {index} from {sender}",
                token=self.plan.token,
                # the first slots' Free said again: a sender that joined the store late missed it
                every=partial(self._free, index) if index < 2 else None,
            )
        )
        if isinstance(got, Stop):
            raise UpdateAbortedError(f"{self.plan.parent} stopped relaying: {got.reason}")
        if got.slot != index % 2:
            raise WireFormatError(
                f"bucket {index} came in slot {got.slot}; it belongs in {index % 2}"
            )
        if (
            got.header_at + got.header_bytes > self.plan.bucket_bytes
            or (got.changes or got.data_bytes) > got.header_at
            or got.data_bytes > self.plan.bucket_bytes
        ):
            raise WireFormatError(
                f"bucket {index}'s header lies outside its {self.plan.bucket_bytes} bytes"
            )
        if got.changes and (self.copies is None or not self.base or self.base != self.plan.base):
            raise WireFormatError(
                f"bucket {index} came as changes against update {self.plan.base or 'none'}, "
                f"but this worker's copies hold {self.base or 'none'}"
            )
        return got

    async def _relay(self, msg: Bucket) -> list[tuple[str, Handle]]:
        """Start the puts of bucket ``msg`` to every child that freed its slot for it."""
        if not self.children.peers:
            return []
        await self.children.wait_free(msg.index)
        self._live()
        self.children.take_stops()
        src = self._slot(msg.slot)[: msg.header_at + msg.header_bytes]
        return self.children.post(src, msg, self.plan.bucket_bytes)

    async def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        self.assembler.begin()
        index = 0
        try:
            await self._open()
            while True:
                msg = await self._bucket(index)
                self._live()  # the wait's thread may return just before a switch
                slot = self._slot(msg.slot)
                raw = slot[msg.header_at : msg.header_at + msg.header_bytes].cpu().numpy().tobytes()
                pieces = read_header(raw, msg.data_bytes)
                relays = await self._relay(msg)  # as it came: the children hold the same base
                data = slot
                if msg.changes:
                    assert self.copies is not None and self.scratch is not None
                    self.copies.apply(pieces, slot[: msg.changes], self.scratch)
                    data = self.scratch
                elif self.copies is not None:
                    self.copies.store(pieces, slot)
                for name, tensor in self.assembler.tensors(data, pieces):
                    yield name, tensor
                    self._live()
                await self.children.land(relays)
                self._live()
                self.buckets += 1
                if msg.last:
                    self.assembler.check_complete()
                    if self.copies is not None:  # they hold this update now
                        self.copies.end(self.plan.token)
                    return
                self._free(index + 2)
                index += 1
        except (TransportError, asyncio.CancelledError, GeneratorExit) as e:
            error: BaseException = e
            whole = isinstance(e, PeerGoneError) and e.peer in self.plan.trainers
            if isinstance(e, PeerGoneError) and whole:
                rank = self.plan.trainers.index(e.peer)
                error = UpdateAbortedError(
                    f"trainer rank {rank} ({e.peer}) is gone ({e.why}); {self.transport.name} "
                    f"received {self.buckets} buckets of the update, which is incomplete"
                )
            elif isinstance(e, PeerGoneError):
                error = UpdateAbortedError(
                    f"relay {e.peer}, this worker's parent, is gone ({e.why})"
                )
            why = str(error)[:MAX_REASON] or type(e).__name__
            tell(
                self.transport,
                [*self.plan.trainers, *self.children.peers],
                Stop(self.plan.token, why, whole),
            )
            if error is e:
                raise
            raise error from e
