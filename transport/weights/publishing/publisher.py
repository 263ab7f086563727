"""WeightPublisher: the trainer's side of a weight group."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, overload

import torch

from transport import (
    Handle,
    PeerLostError,
    PeerNotFoundError,
    TransferTimeout,
    Transport,
    TransportError,
)
from transport.weights.delta.codec import Encoded
from transport.weights.delta.source import DeltaSource, check_delta
from transport.weights.group.lease import PublisherLease
from transport.weights.group.messages import (
    Abort,
    Begin,
    Credit,
    Forward,
    Hello,
    Lend,
    Message,
    Patch,
    Report,
    Target,
    Ver,
    encode,
)
from transport.weights.group.region_names import (
    PUB_SLOT,
    SEQ_NAME,
    channel,
    check_named_tensors,
    inbox_region,
    region,
)
from transport.weights.group.segments import (
    SEGMENT_BYTES,
    SegmentedWrite,
    piece_bytes,
    segment_batches,
)
from transport.weights.group.seqword import SeqWord
from transport.weights.group.withdraw import leftovers, withdraw
from transport.weights.publishing.core import PublisherCore
from transport.weights.publishing.delivery import DONE, EXCLUDED, Delivery, PublishHandle
from transport.weights.publishing.handover import Handover
from transport.weights.publishing.members import (
    Fence,
    PatchInFlight,
    PublisherMember,
    Retired,
    Waiting,
)
from transport.weights.publishing.pack import Pack
from transport.weights.publishing.roster import check_fanout, fanout_tree

log = logging.getLogger(__name__)


class WeightPublisher(Handover, PublisherCore[PublisherMember]):
    """Publishes ``named_tensors`` to every subscriber of ``group``.

    Subscribers are found through the store (one read per publish notices joins and leaves). For
    each subscriber the publisher checks names, shapes and dtypes once (a subscriber may take a
    subset of the names) and prepares one batched transfer per staging slot, which every publish
    replays. :meth:`publish` sends to all subscribers at once and returns a :class:`PublishHandle`
    whose result tells, per subscriber, done, excluded or lost.

    Small, separately allocated tensors go through one buffer, or as they are to a subscriber
    of this machine: weights/publishing/pack.py says when, and what a late joiner's pull() reads.

    Membership (weights/publishing/roster.py): a subscriber whose heartbeat stopped is suspect
    (transport/peers/liveness.py) and excluded from a publish at once, with that reason, instead of at
    the deadline, whether it was suspect when the publish began or became so while the publish
    waited for it (its heartbeat is read every ``heartbeat_interval`` meanwhile); one that could
    not be planned (no record yet, tensors that do not match) is planned again at every publish;
    both are served again once the cause is gone. When the store loses the group (it restarted
    empty), the subscribers the publisher knew are served over their connections until they join
    again.

    ``fanout`` chooses who writes each subscriber: ``"direct"`` (the publisher writes every one),
    ``"chain"`` (the publisher writes the first, each subscriber forwards to the next) or
    ``"tree"`` (the publisher writes the first, each subscriber forwards to ``degree`` more, and
    so on). Relays forward a version segment by segment as it lands with them, from their
    staging slot (only staging subscribers that allow it relay; a subscriber is placed under a
    relay only if the relay holds every tensor it takes, else the publisher writes it). The
    trainer then sends each version once instead of once per subscriber: its link carries the
    model once. It can be changed between publishes (:attr:`fanout`, :attr:`degree`,
    :attr:`segment_bytes`). A relay that becomes suspect during a publish (a cut link) leaves
    a gap: the publisher writes its children itself, within the same deadline, into the slot
    each hands back once it applied its newest version (the slot the relay had stays fenced).

    A group has one publisher at a time, in whichever process: it holds the group's lease in the
    store (weights/group/lease.py) from construction to :meth:`close`; a second one fails with
    GroupBusyError naming the holder, and takes over once the holder is gone.

    ``delta=True`` sends each version as its changes against the version before it
    (weights/delta/), diffed against a copy of it (one more copy of the tensors, where they
    live) before :meth:`publish` returns, to every subscriber that holds that version, takes
    every tensor and has an inbox (``WeightSubscriber(delta=True)``); the others, and versions
    whose changes exceed half their bytes, go whole. A subscriber that cannot apply them says
    so and gets the version whole within the same deadline. A relay that took the changes
    forwards them to each child holding their base, the others whole; one whose forwards may
    still read its inbox takes the next version whole. ``delta="auto"`` diffs only while diff
    and changes take less time than whole versions took (weights/delta/policy.py): on a link
    fast enough for whole versions it stops diffing, drops its copy, and looks again now and
    then.
    """

    def __init__(
        self,
        transport: Transport,
        named_tensors: Mapping[str, torch.Tensor],
        group: str = "policy",
        fanout: str = "direct",
        degree: int = 2,
        delta: bool | str = False,
    ) -> None:
        self.fanout, self.degree = check_fanout(fanout, degree)
        self._segment_bytes = SEGMENT_BYTES
        self.tensors = check_named_tensors(named_tensors, "publisher")
        self._delta = check_delta(delta)
        self._switch_deltas(self._delta)
        # small separately allocated tensors through one buffer (see the class's docstring)
        self._pack = Pack(self.tensors)
        self._sources = self._pack.sources
        # Late joiners read the newest version straight from here (see updating() and
        # WeightSubscriber.pull()): the tensors are exposed read-only, next to a sequence word
        # [seq, version] that is odd while the trainer changes them.
        self._word = SeqWord()
        self._relays: set[str] = set()  # the subscribers that forward the current version
        self._exposed: list[str] = []
        super().__init__(
            transport,
            group,
            self._sources,
            PublisherLease(transport, group),
            f"transport-ws-pub-{group}",
            PublisherMember,
            on_gap=self._close_gap,
            unpacked=self.tensors if self._pack.names and not self._pack.exposed else None,
        )
        try:
            read = self._sources if self._pack.exposed else self.tensors  # what pull() reads
            exposed = {region(self.group, PUB_SLOT, n): t for n, t in read.items()}
            exposed[region(self.group, PUB_SLOT, SEQ_NAME)] = self._word.word
            leftovers(transport, group)  # of a closed member of the group, if its close ran out
            transport.expose_all(exposed, access="r")
            self._exposed = list(exposed)
        except BaseException:
            self._undo()
            raise

    # -- membership ------------------------------------------------------------------------------

    def _retired(self, gone: Retired) -> None:
        # The children it was to write (or whose slot stays fenced for it) are the publisher's
        # again: a relay leaves only after its forwards ended (WeightSubscriber.close), and one
        # that was lost or replaced by a newer incarnation writes nothing more.
        self._release_children(gone.member.name, gone.why)

    # -- publishing ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Wrap every change of the tensors (the optimizer step) in it, so that a late joiner's
        :meth:`WeightSubscriber.pull` never takes a half-updated state; the trainer never waits
        for a joiner. Without it, pull() refuses (it cannot tell a stable state from a changing one).
        A version still waiting for a subscriber's slot is never started from then on (the
        tensors no longer hold it): the next publish gives it up."""
        self._tensors_change()
        with self._word.changing():
            yield
            if any(t.is_cuda for t in self.tensors.values()):
                torch.cuda.synchronize()  # the change must have happened before we say so

    @overload
    def publish(
        self, version: int | None = None, timeout: float | None = None, stream: None = None
    ) -> PublishHandle: ...

    @overload
    def publish(
        self, version: None = None, timeout: float | None = None, *, stream: Any
    ) -> Any: ...

    def publish(
        self, version: int | None = None, timeout: float | None = None, stream: Any = None
    ) -> Any:
        """Send the tensors as ``version`` (default: the next one) to every subscriber; returns
        a :class:`PublishHandle` at once.

        With ``stream=`` (a ``torch.cuda.Stream``) the publish is ordered on that stream: it
        starts once the work queued before it (the optimizer step) has run, and returns a
        ``StreamHandle`` whose ``wait_stream()`` holds later work until every subscriber has an
        outcome. Inside ``torch.cuda.graph`` capture it is recorded, and every replay publishes
        the next version. Versions are then counted by the publisher (``version`` must be None).
        """
        if stream is not None:
            if version is not None:
                raise ValueError(
                    "with stream=, each run (or graph replay) publishes the next version: "
                    "pass version=None and read pub.version"
                )
            ops = self.transport.core.stream_ops()
            if timeout is not None and not timeout > 0:
                raise ValueError(f"timeout must be positive, got {timeout!r}")
            return ops.enqueue(
                ("publish", self.group, id(self)),
                lambda: self.publish(None, timeout),
                f"publish of group {self.group!r}",
                stream,
            )
        version = self._next_version(version)
        timeout = self.transport.timeout if timeout is None else timeout
        with self._reading_ahead():
            self._refresh_for_publish()
            if self._pack.exposed:  # pull() reads it: filled at every publish
                self._fill_pack(version)
            if self._deltas is not None:
                with self._lock:  # a write of the previous changes may still read the outbox
                    patching = any(s.patch is not None for s in self._subs.values())
                    self._deltas.stage(version, self.tensors, patching)
            with self._lock:
                handle, direct = self._begin(version, timeout, "no free slot")
                self._word.stamp(version)
                via = fanout_tree(direct, self.fanout, self.degree)
                self._relays = set(via.values())
                for sub in direct:
                    self._start(sub, version, handle, via.get(sub.name))
        return handle.handle

    def _fill_pack(self, version: int) -> None:
        """Copy the tensors into the pack for ``version``, unless it holds them already (a late
        joiner's pull() of an exposed pack sees it changing meanwhile)."""
        if self._pack.names and self._pack.holds != version:
            exposed = self._pack.exposed
            with self._word.filling() if exposed else contextlib.nullcontext():
                self._pack.fill(version)

    def _may_start(
        self, sub: PublisherMember, version: int, handle: Delivery, via: str | None = None
    ) -> bool:
        if not super()._may_start(sub, version, handle, via):
            return False
        if not sub.unpacked:  # it writes from the pack: which must hold the version first
            self._fill_pack(version)
        return True

    def _patch_for(self, sub: PublisherMember, version: int) -> Encoded | None:
        """With the lock held: ``version``'s changes if ``sub`` takes them (it holds their base:
        the slot written holds it, or is made a copy of the newest); None: whole. A relay whose
        forwards of an older version may still read its inbox takes the version whole."""
        if self._deltas is None or any(
            m.relay == sub.name and m.relay_handle is not None and m.writing < version
            for m in self._subs.values()
        ):
            return None
        return self._deltas.changes_for(version, sub.completed, sub.inbox, len(sub.names))

    def _start(
        self, sub: PublisherMember, version: int, handle: Delivery, via: str | None = None
    ) -> None:
        """With the lock held: write ``version`` into a free slot of ``sub`` now (or have relay
        ``via`` write it), or wait for a free slot; never unless :meth:`_may_start`
        (the tensors may hold the next version's bytes by then, which would land under this
        version's number)."""
        if not self._may_start(sub, version, handle, via):
            return
        slot = sub.free_slot(direct=via is None)
        if sub.busy is not None or slot is None:
            sub.waiting = Waiting(version, handle, via)
            if sub.busy is None and sub.fenced and sub.lend_asked < version:
                sub.lend_asked = version  # once: it lends when it can (its newest, once applied)
                self._worker.submit(lambda: self._send(sub.name, Lend(version)))
            return
        sub.busy, sub.writing = slot, version
        self.transport.recorder.record(
            "ws-plan", op="start", peers=sub.name, info=f"v{version} slot {slot} via {via}"
        )
        if sub.mode == "staging":
            sub.credits.spend(slot)
        left = handle.deadline - time.monotonic()
        patch = self._patch_for(sub, version)
        if via is not None and via in self._subs and left > 0:
            # changes if the relay takes them too (else it writes the version whole)
            both = patch is not None and self._patch_for(self._subs[via], version) is not None
            base = patch.base if both and patch is not None else -1
            target = Target(sub.name, slot, sub.name in self._relays, base)
            fwd = Forward(version, max(1, int(left * 1000)), (target,))
            try:
                self.transport.core.send_control(via, channel(self.group), encode(fwd))
            except TransportError as e:
                log.info("group %s: %s cannot relay version %d: %s", self.group, via, version, e)
            else:
                sub.relay, sub.relay_handle = via, handle
                handle.result.via[sub.name] = via
                return
        if sub.name in self._relays and left > 0 and patch is None:
            self._write_segments(sub, slot, version, handle)
            return
        self._write(sub, slot, version, handle, patch)

    def _write(
        self, sub: PublisherMember, slot: int, version: int, handle: Delivery, patch: Encoded | None
    ) -> None:
        """With the lock held: write ``version`` into ``slot`` of ``sub``: whole, or its changes
        ``patch`` (staged in the outbox) into its inbox (it answers ``patched``)."""
        core, chan = self.transport.core, channel(self.group)
        try:
            left = handle.deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout("the deadline passed before a slot was free")
            core.send_control(sub.name, chan, encode(Begin(version, slot)))
            sub.started = time.monotonic()
            if patch is not None:
                n = patch.blob.numel()
                h = core.put_control_at(
                    patch.blob,
                    inbox_region(self.group),
                    0,
                    sub.name,
                    chan,
                    encode(Patch(version, slot, patch.base, n)),
                    left,
                )
                sub.patch = PatchInFlight(version, slot, handle, n)
            else:
                h = core.put_control(
                    sub.batches[slot], sub.name, chan, encode(Ver(version, slot)), left
                )
                handle.track(sub.name, h)  # it reads the tensors: the version waits for it
        except TransportError as e:
            self._finished(sub, slot, version, handle, e)
            return
        if patch is not None:
            h.add_done_callback(
                lambda h: self._worker.submit(lambda: self._on_patch_put(sub, slot, version, h))
            )
        else:
            h.add_done_callback(lambda h: self._on_written_now(sub, slot, version, handle, h))

    def _write_whole(self, sub: PublisherMember, slot: int, version: int, handle: Delivery) -> None:
        if not sub.unpacked:  # the changes it refused came from the outbox, not the pack
            self._fill_pack(version)
        self._write(sub, slot, version, handle, None)

    def _write_segments(
        self, sub: PublisherMember, slot: int, version: int, handle: Delivery
    ) -> None:
        """With the lock held: write a relay in segments, each announced as it lands, so that it
        forwards while the rest is still on its way (see ``transport.weights.group``)."""
        segs = sub.segments.get(slot)
        if segs is None:
            src = self.tensors if sub.unpacked else self._sources
            mine = {n: src[n] for n in sub.names}
            segs = sub.segments[slot] = segment_batches(mine, self.group, slot, self._segment_bytes)
        write = SegmentedWrite(
            self.transport,
            sub.name,
            self.group,
            version,
            slot,
            handle.deadline,
            True,
            self._worker.submit,
            lambda err: self._worker.submit(
                lambda: self._on_written(sub, slot, version, handle, err)
            ),
        )
        write.track = functools.partial(handle.track, sub.name)
        if write.begin():
            write.post(segs, self._segment_bytes, piece_bytes(self.transport, self._segment_bytes))

    def _on_written(
        self,
        sub: PublisherMember,
        slot: int,
        version: int,
        handle: Delivery,
        err: BaseException | None,
    ) -> None:
        with self._lock:
            self._fence_if_unsure(sub, slot, version, err)
            self._finished(sub, slot, version, handle, err)

    def _on_written_now(
        self, sub: PublisherMember, slot: int, version: int, handle: Delivery, h: Handle
    ) -> None:
        """Engine thread: the write of ``version`` to ``sub`` ended. When that is all there is
        to settle (it landed, the lock is free at once, no version waits for ``sub``, no changes
        are counted, ``sub`` is still the member), its outcome is given here, a thread switch
        sooner; anything else goes to the worker (:meth:`_on_done`), which may write again."""
        if self._deltas is None and h.exception(0) is None and self._lock.acquire(blocking=False):
            try:
                if sub.waiting is None and not sub.retired:
                    self._finished(sub, slot, version, handle, None)
                    return
            finally:
                self._lock.release()
        self._worker.submit(lambda: self._on_done(sub, slot, version, handle, h))

    def _on_done(
        self, sub: PublisherMember, slot: int, version: int, handle: Delivery, h: Handle
    ) -> None:
        with self._lock:
            err = h.exception(0)
            if err is None and self._deltas is not None:
                self._deltas.policy.wrote(False, time.monotonic() - sub.started)
            self._fence_if_unsure(sub, slot, version, err)
            self._finished(sub, slot, version, handle, err)

    def _fence_if_unsure(
        self, sub: PublisherMember, slot: int, version: int, err: BaseException | None
    ) -> None:
        """With the lock held: our put of ``version`` into ``slot`` ended at its deadline. The
        transfer is given up, not withdrawn: what was already handed to the connection may
        still land there (a link that comes back). The slot is fenced until a later write of
        ours to this incarnation lands (the connection delivers in order), so that no relay
        writes a newer version under those bytes."""
        if isinstance(err, TransferTimeout) and sub.mode == "staging":
            sub.fenced[slot] = Fence(None, version)
            self.transport.recorder.record(
                "ws-plan", op="fence", peers=sub.name, info=f"v{version} slot {slot}: unsure"
            )

    def _replaced(self, old: PublisherMember) -> None:
        """With the lock held: ``old`` was planned again as another member of the same
        incarnation. What ``old`` may still be writing stays fenced in the new member (its
        write ends on ``old``'s account, which unfences it: :meth:`_finished`)."""
        new = self._subs.get(old.name)
        if new is None or new is old or new.generation != old.generation:
            return
        new.fenced.update(old.fenced)
        if old.busy is not None:
            new.fenced[old.busy] = Fence(old.relay, old.writing)

    def _finished(
        self,
        sub: PublisherMember,
        slot: int,
        version: int,
        handle: Delivery,
        err: BaseException | None,
    ) -> None:
        self.transport.recorder.record(
            "ws-plan",
            op="finished",
            peers=sub.name,
            info=f"v{version} slot {slot}: {'done' if err is None else repr(err)[:150]}",
        )
        direct = sub.relay is None
        sub.busy, sub.relay, sub.relay_handle, sub.patch = None, None, None, None
        if direct and err is None:
            # what we wrote before this write has drained (one connection delivers in order),
            # and so has this write, into a member planned again since (:meth:`_replaced`)
            self._drained(sub, version)
        if err is None:
            sub.completed = max(sub.completed, version)
            handle.settle(sub.name, DONE)
        elif isinstance(err, PeerLostError):
            self._lost(sub, handle, err)
        elif isinstance(err, PeerNotFoundError):
            self._unrecorded(sub, version, handle, err)
        else:
            if sub.mode == "staging" and not sub.retired:
                # Nothing was announced in the slot, but the subscriber may read it (a relay
                # forwarding what landed of it): it says which slots are free when it runs again,
                # and ignores the version's ``ver`` should it still come (the write was withdrawn
                # at its deadline, but its notification may have been on its way).
                abort = Abort(version=version, slot=slot)
                self._worker.submit(lambda: self._ask_credits(sub, abort))
            handle.settle(sub.name, EXCLUDED, str(err))
        self._resume(sub)

    def _drained(self, sub: PublisherMember, version: int) -> None:
        """With the lock held: our writes to ``sub``'s incarnation up to ``version`` drained."""
        sub.unfence(None, version)
        now = self._subs.get(sub.name)
        if sub.retired and now is not None and now.generation == sub.generation:
            now.unfence(None, version)
            self._resume(now)

    def _ask_credits(self, sub: PublisherMember, abort: Abort | None = None) -> None:
        """Ask ``sub`` which slots are free: ``hello``, or ``abort`` (a version given up in a
        slot), whose answer says it too."""
        sub.asked = time.monotonic()
        self._send(sub.name, Hello() if abort is None else abort)

    def _on_other(self, peer: str, m: Message) -> None:
        if isinstance(m, Report) and peer in self._subs:
            # only a member relays; a relay that floods the worker may lose a report (the
            # child's slot then stays the relay's until it leaves or is gone)
            self._worker.offer(lambda: self._on_relayed(peer, m))

    def _on_credit(self, peer: str, credit: Credit) -> None:
        slots, newest = credit.slots, credit.newest
        with self._lock:
            sub = self._subs.get(peer)
            ignored = (
                sub is None
                or sub.mode != "staging"
                or newest < sub.completed
                or (sub.busy is not None and newest < sub.writing)
            )
            self.transport.recorder.record(
                "ws-plan", op="credit", peers=peer, info=f"{credit!r} ignored={ignored}"[:200]
            )
            if ignored or sub is None:
                return  # unknown, or sent before it saw our latest version (it may name the busy slot)
            # never the slot being written: a credit cannot be for what follows that write (it
            # is credited anew once the write landed, or was given up)
            sub.credits.say(s for s in slots if 0 <= s < sub.slots and s != sub.busy)
            if sub.busy is None:
                self._resume(sub)

    def _member_deadlines(self, sub: PublisherMember, now: float) -> None:
        """A forward its relay did not report on in time is excluded."""
        h = sub.relay_handle
        if h is not None and h.deadline <= now and sub.name in h.pending:
            # Excluded now; the slot stays the relay's until it reports or is gone.
            h.settle(
                sub.name,
                EXCLUDED,
                f"relay {sub.relay} did not forward version {sub.writing} within the deadline",
            )

    def _no_start(self, sub: PublisherMember, version: int) -> str:
        return sub.no_slot(version)

    def _awaits_credit(self, sub: PublisherMember) -> bool:
        return sub.mode == "staging" and not sub.credits

    @property
    def segment_bytes(self) -> int:
        """How large the segments are that a version travels to a relay in (each forwarded as
        it lands: a chain of N hops costs about one segment's time per hop on top of the
        version's); from the next version on when set. Default 32 MiB."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 4096:
            raise ValueError(f"segment_bytes must be an int of at least 4096, got {value!r}")
        with self._lock:
            self._segment_bytes = value
            for sub in self._subs.values():
                sub.segments.clear()  # cut again at the next write

    def _switch_deltas(self, mode: bool | str) -> None:
        self._deltas: DeltaSource | None = (
            DeltaSource(self.tensors, mode == "auto") if mode else None
        )

    @property
    def fanout(self) -> str:
        return self._fanout

    @fanout.setter
    def fanout(self, value: str) -> None:
        self._fanout, _ = check_fanout(value, 1)

    @property
    def degree(self) -> int:
        return self._degree

    @degree.setter
    def degree(self, value: int) -> None:
        _, self._degree = check_fanout("tree", value)

    def close(self) -> None:
        """Stop publishing. A publish still in flight completes now: its handle fails with
        ClosedError (the versions the subscribers completed stay theirs). The regions late
        joiners read are withdrawn (``Transport.unexpose``; at most ``min(transport.timeout,
        10)`` seconds in all, see weights/group/withdraw.py) and the lease given back, so that a
        new publisher of the group may use this Transport. Idempotent."""
        super().close()

    def _closing(self) -> None:
        names, self._exposed = self._exposed, []
        withdraw(self.transport, names, f"the publisher of group {self.group!r}")
