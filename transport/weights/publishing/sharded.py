"""ShardedPublisher: one rank of a sharded trainer, writing its own shards into each generator's
layout."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable, Mapping

import torch

from transport import (
    ClosedError,
    Handle,
    LayoutError,
    PeerLostError,
    PeerNotFoundError,
    Transport,
    TransportError,
    WireFormatError,
)
from transport.contract import dtype_name
from transport.weights.delta.codec import Encoded
from transport.weights.delta.ranks import Planner, RankDeltas
from transport.weights.delta.source import check_delta
from transport.weights.group.group_directory import WHOLE, GroupDirectory
from transport.weights.group.lease import PublisherLease
from transport.weights.group.messages import (
    Abort,
    Begin,
    Credit,
    Patch,
    Ver,
    encode,
)
from transport.weights.group.region_names import channel, inbox_region, region
from transport.weights.group.worker import Worker
from transport.weights.layouts import (
    DestTensor,
    SourceLayout,
    check,
    check_shards,
    full_copy,
    plan_all,
)
from transport.weights.layouts.encoding import decode_dest, decode_sources, source_digest
from transport.weights.publishing.core import PublisherCore
from transport.weights.publishing.delivery import DONE, EXCLUDED, Delivery, Landing, PublishHandle
from transport.weights.publishing.members import Acked, PatchInFlight, RankMember, Waiting
from transport.weights.publishing.trainer_ranks import TrainerRanks
from transport.weights.publishing.write_plan import SlotWrites, plan_writes

log = logging.getLogger(__name__)

#: bytes of converted data per transfer, and the pool of staging buffers they go through
CHUNK_BYTES = 8 << 20
POOL_BYTES = 32 << 20


class ShardedPublisher(PublisherCore[RankMember]):
    """Rank ``rank`` of a sharded trainer: publishes its ``shards`` (name -> the slice
    ``layout`` says this rank holds) to every subscriber of ``group``.

    Every rank of the trainer makes one, with the same :class:`SourceLayout` (the ranks check
    that they agree through the store; they need no process group) and its own shards, and
    every rank publishes each version. For each subscriber a rank writes only the parts of the
    subscriber's tensors that its shards cover (the subscriber's declared layout: its own TP
    shard, fused parameters, renames, another dtype; without one, whole tensors by name):
    byte runs planned once per subscriber and replayed every version, converted on the way
    through a pool of ``pool_bytes`` of staging buffers where the subscriber asks for another
    dtype (the next chunk converts while the last is in flight). With ``pack_strided``, short
    runs that are strided in the shard but adjacent at the destination (a column box of a row
    shard) are packed through the same pool: one descriptor per chunk instead of one per row.
    A replicated tensor is written by one rank per destination piece, dealt round robin.

    A subscriber completes a version only when every rank's parts of it landed, into the same
    slot. Each rank starts a version at a subscriber only once the subscriber is done with the
    version this rank wrote before (complete or given up), so the ranks always pick the same
    slot. A version that does not complete by the deadline is given up (the subscriber keeps the
    version before it) and the :class:`PublishResult` names the ranks that are missing and why
    (gone, never published it, or slow). Versions only move forward: after a failed version,
    every rank publishes the next one. Relays, ``pull`` and stream-ordered publishes are the
    plain :class:`WeightPublisher`'s; a sharded group writes every subscriber directly.

    One publisher per rank of a group, in whichever process (the rank's lease in the store).

    ``delta=True`` (or ``"auto"``, as for :class:`WeightPublisher`) sends each version to a
    subscriber with an inbox (``WeightSubscriber(delta=...)``) as the changes of this rank's
    parts against the version the slot it writes holds (weights/delta/ranks.py): the rank
    keeps a copy of the bytes it writes to each subscriber layout, converted as written, and
    writes the changes of the converted bytes into its own share of the inbox (``1/world`` of
    it). A slot that holds another version, changes too dense or too large for that share,
    and a refusal mean this rank's parts go whole into the same slot (each rank decides for
    its own parts; the subscriber keeps its free slot a copy of its newest version, so every
    rank's changes apply there with no copy on the way).
    """

    def __init__(
        self,
        transport: Transport,
        shards: Mapping[str, torch.Tensor],
        layout: SourceLayout,
        rank: int,
        group: str = "policy",
        pool_bytes: int = POOL_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        pack_strided: bool = True,
        delta: bool | str = False,
    ) -> None:
        if not isinstance(layout, SourceLayout):
            raise TypeError("layout must be a SourceLayout (every rank's share of each tensor)")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < layout.world:
            raise ValueError(f"rank must be an int from 0 to {layout.world - 1}, got {rank!r}")
        if not 0 < chunk_bytes <= pool_bytes:
            raise ValueError("chunk_bytes must be positive and at most pool_bytes")
        check(layout, {})  # gaps and overlaps of the source itself
        self._local = check_shards(shards, layout, rank)
        self.layout, self.rank = layout, rank
        self.world = layout.world
        self.digest = source_digest(layout)
        self._chunk_bytes, self._pack = chunk_bytes, pack_strided
        device = next(iter(self._local.values())).device
        self._on_cuda = device.type == "cuda"  # the GPU path: torch ops on the device (untested)
        self._pool = [
            torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
            for _ in range(max(1, pool_bytes // chunk_bytes))
        ]
        self._pool_busy: list[Handle | None] = [None] * len(self._pool)
        # how each layout of a subscriber with an inbox is diffed (planned with its writes, kept
        # while such a subscriber is there): a delta turned on later plans with these
        self._delta_plans: dict[Hashable, tuple[Mapping[str, DestTensor], Planner]] = {}
        self._delta = check_delta(delta)
        self._switch_deltas(self._delta)
        self._dir = GroupDirectory(transport.core.signed, transport.namespace, group)
        self._ranks = TrainerRanks(transport, self._dir, rank, self.world, self.digest)
        self._writer = Worker(
            f"transport-ws-rank{rank}-{group}-writes", until=lambda: transport.closed
        )
        super().__init__(
            transport,
            group,
            self._local,
            PublisherLease(transport, group, rank, self.world, self.digest),
            f"transport-ws-rank{rank}-{group}",
            RankMember,
            planner=self._plan_member,
        )
        try:
            self._ranks.published(-1)
        except BaseException:
            self._undo()
            raise

    # -- planning ----------------------------------------------------------------------------------

    def _plan_member(self, sub: RankMember, conn: object) -> str:
        """The writes of this rank into ``sub`` (planned once per incarnation), or why not."""
        try:
            raw = self._dir.layout(sub.name, sub.generation)
            if raw is None:
                raise LayoutError(
                    [
                        f"it has no declared layout of its generation {sub.generation} in the store "
                        "(missing, or not valid: see the log)"
                    ]
                )
            regions = conn.regions  # type: ignore[attr-defined]
            prefix = region(self.group, 0, "")
            exposed = {k[len(prefix) :]: v for k, v in regions.items() if k.startswith(prefix)}
            if raw != WHOLE:
                dest = decode_dest(raw)
                expected = decode_sources(raw)
            else:  # whole tensors by name
                dest = full_copy(self.layout, [n for n in exposed if n in self.layout.tensors])
            problems = [
                f"{n!r}: the subscriber takes it, but no source or layout entry makes it"
                for n in exposed
                if n not in dest
            ]
            for name, d in dest.items():
                info = exposed.get(name)
                if info is None:
                    problems.append(
                        f"{name!r}: in the layout, but the subscriber exposes no such tensor"
                    )
                elif tuple(info.shape) != tuple(d.shape) or info.dtype != dtype_name(d.dtype):
                    problems.append(
                        f"{name!r}: the layout says {tuple(d.shape)} {dtype_name(d.dtype)}, "
                        f"the subscriber exposes {tuple(info.shape)} {info.dtype}"
                    )
            if raw != WHOLE:
                for n, shape in expected.items():
                    have = self.layout.tensors.get(n)
                    if have is not None and tuple(have.shape) != shape:
                        problems.append(
                            f"{n!r}: the subscriber was built for {shape}, this "
                            f"trainer holds {tuple(have.shape)} (another model?)"
                        )
            if not dest:
                problems.append("it takes none of the trainer's tensors")
            if problems:
                raise LayoutError(problems)
            runs, boxes = plan_all(self.layout, dest, self.rank)
            inbox = regions.get(inbox_region(self.group))
            sub.inbox = inbox.nbytes if inbox is not None and inbox.writable else 0
            sub.delta_key = raw if raw != WHOLE else tuple(sorted(dest))
            if sub.inbox:
                plan = (dest, lambda pool: plan_writes(pool, str, self._local, runs, boxes, dest))
                self._delta_plans[sub.delta_key] = plan
                if self._deltas is not None:
                    self._deltas.plan(sub.delta_key, *plan)
            sub.writes = [
                plan_writes(
                    self._pool,
                    functools.partial(region, self.group, k),
                    self._local,
                    runs,
                    boxes,
                    dest,
                )
                for k in range(sub.slots)
            ]
        except (LayoutError, WireFormatError) as e:
            return f"subscriber {sub.name!r} does not fit rank {self.rank}'s layout: {e}"
        except TransportError as e:
            return f"cannot read its layout (tried again at the next publish): {e}"
        return ""

    # -- publishing --------------------------------------------------------------------------------

    def publish(self, version: int | None = None, timeout: float | None = None) -> PublishHandle:
        """Write this rank's parts of ``version`` (default: the next) to every subscriber;
        returns a :class:`PublishHandle` at once. A subscriber counts as done only once it
        completed the version, that is, once every rank's parts landed there. LayoutError (before
        anything moves) if another rank of the group declares another source layout."""
        version = self._next_version(version)
        timeout = self.transport.timeout if timeout is None else timeout
        if self._on_cuda:  # what the trainer queued (the optimizer step) has run before we read
            torch.cuda.synchronize(self._pool[0].device)

        def ranks() -> None:
            self._ranks.check()
            self._ranks.published(version)

        with self._reading_ahead():
            self._refresh_for_publish(ranks)
            with self._lock:
                keys = {s.delta_key for s in self._subs.values() if s.inbox and s.writes}
                in_use = any(s.patch is not None for s in self._subs.values())
                for key in [k for k in self._delta_plans if k not in keys]:
                    del self._delta_plans[key]
                deltas = self._deltas
            if deltas is not None:  # the changes of this rank's parts, before any byte moves
                deltas.stage(version, keys, in_use)
            with self._lock:
                handle, start = self._begin(version, timeout, "not begun")
                for sub in start:
                    self._start(sub, version, handle)
        self._worker.submit(lambda: None)  # the tick watches the new deadline
        return handle.handle

    def _ready(self, sub: RankMember) -> bool:
        settled = sub.settled >= sub.last
        return settled and (sub.mode == "inplace" or bool(sub.credits))

    def _start(
        self, sub: RankMember, version: int, handle: Delivery, via: str | None = None
    ) -> None:
        """With the lock held: begin ``version`` at ``sub`` now, or once it is ready; not once
        ``sub`` has its outcome of it (the shards may hold the next version by now). ``via`` is
        always None: a rank writes every subscriber itself."""
        if not self._may_start(sub, version, handle):
            return
        if sub.busy is not None or sub.acked is not None or not self._ready(sub):
            sub.waiting = Waiting(version, handle)
            return
        slot = 0 if sub.mode == "inplace" else sub.credits.free()[0]
        holds = sub.credits.held(slot)
        sub.busy, sub.writing, sub.last = slot, version, version
        sub.credits.spend(slot)
        sub.started = time.monotonic()
        try:
            self.transport.core.send_control(
                sub.name, channel(self.group), encode(Begin(version, slot))
            )
        except TransportError as e:
            self._finished(sub, slot, version, handle, e)
            return
        patch = self._patch_for(sub, holds, version)
        if patch is not None:
            sub.patch = PatchInFlight(version, slot, handle, patch.blob.numel())
            self._writer.submit(functools.partial(self._write_patch, sub, slot, handle, patch))
            return
        self._writer.submit(functools.partial(self._write, sub, slot, version, handle))

    def _patch_for(self, sub: RankMember, holds: int, version: int) -> Encoded | None:
        """With the lock held: the changes of this rank's parts of ``version`` for the slot of
        ``sub`` that its credit said holds version ``holds`` whole, or None (whole). In place
        the live tensors hold the newest version; in staging, with one rank, the subscriber
        copies its newest version into a slot that holds another; with more, the slot itself
        must hold the base."""
        if self._deltas is None or not sub.inbox:
            return None
        if self.world == 1 or sub.mode == "inplace":
            holds = sub.newest
        return self._deltas.changes_for(sub.delta_key, version, holds, self._share(sub))

    def _share(self, sub: RankMember) -> int:
        """Bytes of ``sub``'s inbox that are this rank's (from ``rank * share`` on)."""
        return sub.inbox // self.world // 8 * 8

    def _write_patch(self, sub: RankMember, slot: int, handle: Delivery, patch: Encoded) -> None:
        """Writer thread: this rank's changes into its share of ``sub``'s inbox; the
        subscriber's ``patched`` says the rest."""
        version, n = patch.version, patch.blob.numel()
        at = self.rank * self._share(sub)
        try:
            h = self.transport.core.put_control_at(
                patch.blob,
                inbox_region(self.group),
                at,
                sub.name,
                channel(self.group),
                encode(Patch(version, slot, patch.base, n, at)),
                handle.time_left(),
            )
        except TransportError as e:
            with self._lock:
                if sub.take_patch(version) is not None:
                    self._finished(sub, slot, version, handle, e)
            return
        h.add_done_callback(
            lambda h: self._worker.submit(
                functools.partial(self._on_patch_put, sub, None, version, h)
            )
        )

    def _write_whole(self, sub: RankMember, slot: int, version: int, handle: Delivery) -> None:
        self._writer.submit(functools.partial(self._write, sub, slot, version, handle))

    def _changes(self, version: int) -> str:
        return f"rank {self.rank}'s changes of version {version}"

    def _write(self, sub: RankMember, slot: int, version: int, handle: Delivery) -> None:
        """Writer thread: post this rank's writes of ``version`` into ``slot`` (converting through
        the pool), then ``ver`` once all of them landed."""
        writes: SlotWrites = sub.writes[slot]
        state = Landing()
        done = functools.partial(self._landed, sub, slot, version, handle, state)

        def on_done(h: Handle) -> None:  # engine thread: hand it to the worker
            self._worker.submit(functools.partial(done, h.exception(0)))

        try:
            if writes.direct is not None:
                state.posting()
                h = self.transport.put(writes.direct, sub.name, timeout=handle.time_left())
                handle.track(sub.name, h)  # it reads the tensors: the version waits for it
                h.add_done_callback(on_done)
            for chunk in writes.chunks:
                busy = self._pool_busy[chunk.buffer]
                if busy is not None:  # the pool is bounded: wait for the buffer's last put
                    busy.exception(handle.time_left())
                for fill in chunk.fill:
                    fill()
                if self._on_cuda:  # the conversion kernels must have run before the put reads
                    torch.cuda.current_stream(self._pool[0].device).synchronize()
                state.posting()
                h = self.transport.put(chunk.batch, sub.name, timeout=handle.time_left())
                handle.track(sub.name, h)
                self._pool_busy[chunk.buffer] = h
                h.add_done_callback(on_done)
        except Exception as e:
            state.landed(e)  # the write that raised was counted, and never posted
        done(None)  # the end of posting

    def _landed(
        self,
        sub: RankMember,
        slot: int,
        version: int,
        handle: Delivery,
        state: Landing,
        error: BaseException | None,
    ) -> None:
        """A write of ``version`` landed (or all were posted): ``ver`` once everything did."""
        finished, err = state.landed(error)
        if not finished:
            return
        if err is None and self._deltas is not None:
            self._deltas.policy.wrote(False, time.monotonic() - sub.started)
        if err is None:
            try:
                self.transport.core.send_control(
                    sub.name, channel(self.group), encode(Ver(version, slot))
                )
            except TransportError as e:
                err = e
        with self._lock:
            self._finished(sub, slot, version, handle, err)

    def _finished(
        self, sub: RankMember, slot: int, version: int, handle: Delivery, err: BaseException | None
    ) -> None:
        """With the lock held: this rank's part of ``version`` at ``sub`` landed (it waits to hear
        that the version completed) or failed."""
        sub.busy = None
        if err is None:
            sub.acked = Acked(version, slot, handle)
            self._heard(sub)
            return
        if isinstance(err, PeerLostError):
            self._lost(sub, handle, err)
            return
        if isinstance(err, PeerNotFoundError):
            self._unrecorded(sub, version, handle, err)
            return
        self._give_up(sub, version, slot)
        handle.settle(sub.name, EXCLUDED, f"{err}; {self._ranks.missing(version)}")
        self._resume(sub)

    def _give_up(self, sub: RankMember, version: int, slot: int) -> None:
        abort = Abort(version=version, slot=slot)
        self._worker.submit(functools.partial(self._send, sub.name, abort))

    def _heard(self, sub: RankMember) -> None:
        """With the lock held: settle the version ``sub`` completed or gave up, and begin the next."""
        if sub.acked is not None:
            version, handle = sub.acked.version, sub.acked.handle
            if sub.newest >= version:
                sub.acked = None
                handle.settle(sub.name, DONE)
            elif sub.settled >= version:
                sub.acked = None
                handle.settle(
                    sub.name,
                    EXCLUDED,
                    f"version {version} was given up there; {self._ranks.missing(version)}",
                )
        if sub.acked is None:
            self._resume(sub)

    # -- messages ----------------------------------------------------------------------------------

    def _on_credit(self, peer: str, credit: Credit) -> None:
        with self._lock:
            sub = self._subs.get(peer)
            if sub is None or credit.settled < sub.settled:
                return
            sub.settled, sub.newest = credit.settled, max(sub.newest, credit.newest)
            if sub.mode == "staging":  # never the slot being written (as WeightPublisher)
                slots = [s for s in credit.slots if 0 <= s < sub.slots and s != sub.busy]
                sub.credits.say(slots, [credit.held(s) for s in slots])
            self._heard(sub)

    def _member_deadlines(self, sub: RankMember, now: float) -> None:
        """A version this rank wrote that did not complete by its deadline is given up."""
        acked = sub.acked
        if acked is not None and acked.handle.deadline <= now:
            sub.acked = None
            self._give_up(sub, acked.version, acked.slot)
            acked.handle.settle(
                sub.name,
                EXCLUDED,
                f"version {acked.version} did not complete within the deadline; "
                f"{self._ranks.missing(acked.version)}",
            )
            self._resume(sub)

    def _no_start(self, sub: RankMember, version: int) -> str:
        if sub.error:
            why = sub.error
        elif sub.last >= 0 and sub.settled < sub.last:
            missing = self._ranks.missing(sub.last)
            why = f"the subscriber is not done with version {sub.last}; {missing}"
        else:
            why = "the subscriber never said which slots are free"
        return f"version {version} could not begin within the deadline: {why}"

    def _awaits_credit(self, sub: RankMember) -> bool:
        return sub.settled >= sub.last

    def _switch_deltas(self, mode: bool | str) -> None:
        self._deltas: RankDeltas | None = None
        if mode:
            deltas = RankDeltas(self._pool[0].device, self._chunk_bytes, mode == "auto")
            for key, (dest, planner) in self._delta_plans.items():
                deltas.plan(key, dest, planner)
            self._deltas = deltas

    @property
    def pool_bytes(self) -> int:
        """Bytes of the staging pool conversions go through (the memory this rank holds beyond
        its shards; it is touched only when a subscriber asks for another dtype)."""
        return sum(b.nbytes for b in self._pool)

    def _stop_workers(self) -> None:
        self._writer.stop()
        super()._stop_workers()

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"rank {self.rank} of group {self.group!r} was closed")
