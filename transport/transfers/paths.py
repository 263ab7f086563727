"""The transfer paths of one Transport: what a put or get becomes, and who posts it.

* the **fast path**: a small transfer whose plan is cached is posted by the caller's thread (no
  hand-off); it often completes inside its post;
* the **fast fan-out**: the same for a small tensor to several peers, one post after the other;
* the **general path**: everything else is checked, planned (plan_cache.py) and handed to the
  engine, in parts of ``chunk_bytes``; large host transfers are cut over the lanes (lanes.py);
* **stream-ordered** transfers (``stream=``) are checked and planned now and posted when the
  stream reaches them (transport.cuda);
* **retries**: a transfer whose first post finds its peer gone is planned again on the peer's new
  incarnation, if it restarted, since nothing of it reached the old one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from time import monotonic_ns
from typing import Any

import torch

from transport.backends.base import WRITE
from transport.errors import PeerLostError, TransportError
from transport.handle import Handle
from transport.memory.local import check_tensor
from transport.peers.table import PeerTable
from transport.progress_engine import Op, ProgressEngine
from transport.settings import positive
from transport.shared_state import SharedState, State
from transport.transfers.batch import Batch, Items, Offset, mapping_items
from transport.transfers.lanes import LaneSet
from transport.transfers.plan import Plan
from transport.transfers.plan_cache import PlanCache
from transport.transfers.retries import Retries, unclaimer
from transport.wire import frame_control, frame_user_notification

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """One transfer of the general path as its caller asked for it: ``op`` (WRITE or READ) of
    ``obj`` (a tensor, a mapping name -> tensor, or a Batch) with ``peer`` (a name, or several
    for a fan-out), into or from region ``key`` (None: the name ``obj`` was exposed or
    registered under) at ``offset`` elements; ``notify`` reaches the peer after the data,
    ``timeout`` (None: the Transport's) bounds it. ``stream``: ordered on that CUDA stream.
    The library's own fields: ``frame``, a control message sent as the notification instead of
    ``notify``; ``proxy``, posted by the stream proxy thread (the stream's errors are its own)."""

    op: str
    obj: Any
    peer: str | Iterable[str]
    key: str | None = None
    offset: int = 0
    notify: bytes | None = None
    timeout: float | None = None
    stream: Any = None
    frame: bytes | None = None
    proxy: bool = False


class Transfers:
    """The transfer paths of one Transport (see the module docstring).

    It owns the transfers' way from a call to the engine, the lanes, the stream machinery
    (created on the first ``stream=`` call) and the queue of transfers to retry after a peer
    restart (filled by the engine thread, emptied by a retry thread started on the first).
    Rules: every check runs before anything is posted, and what fails then is raised by the
    call; what fails later is raised by the handle. A transfer's notification goes after all of its data. A retry
    happens only when nothing of the transfer was posted to the old incarnation.
    """

    def __init__(
        self,
        ep: SharedState,
        peers: PeerTable,
        plans: PlanCache,
        local_names: Mapping[tuple[int, int], str],
    ) -> None:
        self._ep = ep
        self._peers = peers
        self._plans = plans
        self._names = local_names
        self.lanes = LaneSet(ep)
        self.stream: Any = None  # transport.cuda.stream.StreamOps, on the first stream= call
        self.inline_count = 0  # small puts and gets that completed inside their post
        self.retries = Retries(ep, peers, plans)

    # -- the fast paths (caller's thread) ----------------------------------------------------

    def fast(
        self,
        op: str,
        t: torch.Tensor,
        peer: str,
        key: str | None,
        *,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
    ) -> Handle | None:
        """Replay a cached small plan from the caller's thread; None when the general path is
        needed."""
        if self.stream is not None:
            self.stream.check()
        ptr, nbytes = t.data_ptr(), t.nbytes
        if key is None:
            key = self._names.get((ptr, nbytes))
        plan = self._plans.lookup((op, peer, (key, ptr, nbytes, t.dtype), offset))
        ep = self._ep
        if (
            plan is None
            or not plan.inline
            or not plan.conn.alive
            or ep.state is not State.OPEN
            or not t.is_contiguous()
            or (timeout is not None and not (type(timeout) in (int, float) and timeout > 0))
        ):
            return None
        if notify is None and plan.direct is not None:
            if not plan.run_direct():  # done inside the call, or the general path is needed
                return None
            self.inline_count += 1
            handle = Handle("put" if op == WRITE else "get", (peer,), nbytes, 0)
            handle.complete_now()
            return handle
        notif = frame_user_notification(notify) if notify is not None else b""
        handle = Handle("put" if op == WRITE else "get", (peer,), nbytes, 1)
        handle.recorder = ep.recorder  # its end is recorded, unless it completes inside the post
        if ep.engine.post_fast(
            handle, plan, notif, ep.settings.timeout if timeout is None else timeout
        ):
            if handle.settled:
                # completed inside its post (it cannot stall): counted, not recorded one by one,
                # so that the ring costs the fastest path nothing it would notice
                self.inline_count += 1
            elif ep.recorder.append is not None:
                ep.recorder.append(
                    (monotonic_ns(), "post", handle.id, handle.op, peer, nbytes, key, "")
                )
            return handle
        return None

    def fast_fanout(
        self,
        t: torch.Tensor,
        peers: list[str] | tuple[str, ...],
        key: str | None,
        *,
        offset: int,
        notify: bytes | None,
        timeout: float | None,
    ) -> Handle | None:
        """A small put to several peers, each a cached one-part plan, posted one after the other
        from the caller's thread (as a single-peer put is); None when the general path is needed.
        A peer whose post fails (it was lost or restarted meanwhile) and the peers after it go
        through the general path, as part of the same handle."""
        if self.stream is not None:
            self.stream.check()
        n = len(peers)
        ep = self._ep
        if n < 2 or n > 64 or ep.state is not State.OPEN or not t.is_contiguous():
            return None
        if timeout is not None and not (type(timeout) in (int, float) and timeout > 0):
            return None
        ptr, nbytes = t.data_ptr(), t.nbytes
        if key is None:
            key = self._names.get((ptr, nbytes))
        sig = (key, ptr, nbytes, t.dtype)
        plans = []
        for peer in peers:
            plan = self._plans.lookup((WRITE, peer, sig, offset)) if type(peer) is str else None
            if plan is None or not plan.inline or not plan.conn.alive:
                return None
            plans.append(plan)
        if len(set(peers)) != n:
            return None  # the general path says why
        notif = frame_user_notification(notify) if notify is not None else b""
        handle = Handle("put", tuple(peers), nbytes * n, n + 1)  # + 1: held until all is posted
        timeout = ep.settings.timeout if timeout is None else timeout
        inflight: list[Op] = []
        done_now: list[str] = []
        for i, plan in enumerate(plans):
            r = ep.engine.post_inline(handle, plan, notif, timeout)
            if r is True:
                done_now.append(peers[i])
            elif r is not None:
                inflight.append(r)
            elif i == 0:
                return None  # nothing sent yet: the general path does it all
            else:
                self.rest_of_fanout(handle, t, tuple(peers[i:]), key, offset, notify, timeout)
                break
        if len(done_now) == n:
            # every part completed inside its post and nothing else saw the handle: counted, not
            # recorded (like a single-peer put on this path)
            handle.complete_now()
            self.inline_count += n
            return handle
        handle.recorder = ep.recorder
        ep.recorder.record("post", handle.id, handle.op, handle.peers, handle.nbytes, key)
        if inflight:
            handle.poller = ep.engine.poller(inflight)
        for peer in done_now:
            handle.part_done(peer, None)
        handle.part_done(peers[0], None)  # the hold
        return handle

    def rest_of_fanout(
        self,
        handle: Handle,
        t: torch.Tensor,
        rest: tuple[str, ...],
        key: str | None,
        offset: int,
        notify: bytes | None,
        timeout: float,
    ) -> None:
        """The peers of a fast fan-out from the first whose post failed on: through the general
        path (which re-plans a restarted peer), their parts completing ``handle``'s."""
        try:
            request = Request(WRITE, t, list(rest), key, offset, notify=notify, timeout=timeout)
            sub = self.transfer(request)
        except Exception as e:  # noqa: BLE001 - reported as those peers' error, through the handle
            for p in rest:
                handle.part_done(p, e)
            return

        def done(h: Handle) -> None:
            for p in rest:
                # each failed peer is in errors; a failure that names none is every peer's
                handle.part_done(p, h.errors.get(p) or (None if h.errors else h.error))

        sub.add_done_callback(done)

    # -- the general path --------------------------------------------------------------------

    def control(
        self,
        src: torch.Tensor | Mapping[str, torch.Tensor] | Batch,
        peer: str,
        channel: str,
        payload: bytes,
        *,
        key: str | None = None,
        offset: int = 0,
        timeout: float | None = None,
    ) -> Handle:
        """A put whose notification is a control message of ``channel`` (the library's layers)."""
        frame = frame_control(channel, payload)
        return self.transfer(Request(WRITE, src, peer, key, offset, timeout=timeout, frame=frame))

    def transfer(self, request: Request) -> Handle:
        """The general path: ``request`` checked, planned and handed to the engine (or to the
        stream machinery, for a stream-ordered one); its Handle."""
        ep = self._ep
        if ep.state is not State.OPEN:
            ep.check_open()
        if self.stream is not None and not request.proxy:
            self.stream.check()  # an error of a stream-ordered transfer surfaces here
        if request.stream is not None:
            return self.stream_op(request)
        op, peer, notify, frame = request.op, request.peer, request.notify, request.frame
        peers = (peer,) if isinstance(peer, str) else peer_list(peer)
        items, sig, at = self.items(request.obj, request.key, request.offset)
        timeout = request.timeout
        if timeout is None:
            timeout = ep.settings.timeout
        else:
            positive("timeout", timeout)
        deadline = time.monotonic() + timeout
        notif = (
            frame
            if frame is not None
            else (frame_user_notification(notify) if notify is not None else b"")
        )
        claimed: list[Plan] = []  # never evicted until the handle completes
        try:
            for p in peers:
                claimed.append(self._plans.get(op, p, items, sig, at, claim=True))
            handle, ops, inline = self._ops(op, claimed, items, sig, at, notif, deadline, timeout)
        except BaseException:
            self._plans.unclaim(claimed)
            raise
        handle.add_done_callback(lambda _: self._plans.unclaim(claimed))
        if inline:
            self._post_inline(handle, ops, items, sig, at)
        elif not self.lanes.lanes:
            ep.engine.submit(ops)
        else:
            by_engine: dict[int, tuple[ProgressEngine, list[Op]]] = {}
            for o in ops:
                eng = o.engine or ep.engine
                by_engine.setdefault(id(eng), (eng, []))[1].append(o)
            for eng, group_ops in by_engine.values():
                eng.submit(group_ops)
        return handle

    def _ops(
        self,
        op: str,
        claimed: list[Plan],
        items: Items,
        sig: tuple[Any, ...],
        offset: Offset,
        notif: bytes,
        deadline: float,
        timeout: float,
    ) -> tuple[Handle, list[Op], bool]:
        """The handle and the ops of a transfer on ``claimed`` plans (one per peer; a plan made
        again is claimed there too), and whether they are posted by the caller (small, one part
        each)."""
        ep = self._ep
        peers = tuple(p.conn.name for p in claimed)
        handle = Handle("put" if op == WRITE else "get", peers, sum(p.nbytes for p in claimed), 0)
        handle.recorder = ep.recorder
        # names only (the signature holds no tensor): the ring must not keep memory alive
        ep.recorder.record(
            "post",
            handle.id,
            handle.op,
            peers,
            handle.nbytes,
            items[0][0] if len(items) == 1 else sig,
        )
        ops: list[Op] = []
        inline = True
        settings = ep.settings
        for plan in list(claimed):
            if settings.lanes > 1 and plan.nbytes >= settings.lane_bytes and plan.rows.host_only:
                args = (items, sig, offset, notif, deadline, timeout)
                try:
                    ops.extend(self._lane_ops(handle, plan, *args))
                except PeerLostError:
                    if plan.conn.alive:
                        raise
                    # its connection was dropped while the plan was cut (a newer incarnation)
                    again = self._plans.get(op, plan.conn.name, items, sig, offset, claim=True)
                    claimed.append(again)
                    ops.extend(self._lane_ops(handle, again, *args))
                inline = False
                continue
            parts = plan.parts
            if len(parts) == 1:
                ops.append(Op(handle, plan, parts[0], notif, deadline, timeout))
                inline = inline and plan.nbytes <= settings.inline_bytes
                continue
            inline = False
            group = [Op(handle, plan, part, b"", deadline, timeout) for part in parts[:-1]]
            last = Op(handle, plan, parts[-1], notif, deadline, timeout)
            if notif:
                last.after = list(group)  # the notification goes after every other part has landed
            group.append(last)
            for o in group:
                o.group = group
            group[0].retry = (items, sig, offset)
            ops.extend(group)
        if not inline:
            for o in ops:
                if o.group is None:
                    o.group = [o]
                    o.retry = (items, sig, offset)
        handle.set_parts(len(ops))
        handle.canceller = functools.partial(ep.engine.give_up, ops)
        return handle, ops, inline

    def _post_inline(
        self, handle: Handle, ops: list[Op], items: Items, sig: tuple[Any, ...], offset: Offset
    ) -> None:
        """Small one-part transfers: posted by the caller's thread, polled by whoever waits."""
        engine = self._ep.engine
        handle.poller = engine.poller(ops)
        for i, o in enumerate(ops):
            try:
                engine.post_now(o, lost_raises=True)
            except PeerLostError as e:
                retry = self._after_loss(o, items, sig, offset)
                if retry is None:
                    engine.fail(o, e)
                else:
                    ops[i] = retry  # the poller sees the list, so it polls the retry
                    engine.post_now(retry)

    def _lane_ops(
        self,
        handle: Handle,
        plan: Plan,
        items: Items,
        sig: tuple[Any, ...],
        offset: Offset,
        notif: bytes,
        deadline: float,
        timeout: float,
    ) -> list[Op]:
        """The ops of one large transfer cut over the lanes: one group; the notification on the
        last part of share 0, after every other part of every share has landed."""
        shares = self.lanes.split(plan, items)
        main = self._ep.engine
        group: list[Op] = []
        for share, lane in shares:
            eng = lane.engine if lane is not None else main
            for part in share.parts:
                o = Op(handle, share, part, b"", deadline, timeout)
                o.engine = eng
                group.append(o)
        last = group[len(shares[0][0].parts) - 1]
        if notif:
            last.notif = notif
            last.after = [o for o in group if o is not last]
        # The first part goes alone: if it finds the peer restarted, nothing else was posted and
        # the whole transfer is re-planned on the new incarnation (as an unsplit one would be).
        first = group[0]
        assert first is not last or len(group) == 1
        first.retry = (items, sig, offset)
        for o in group[1:]:
            if o.after is None:
                # share 0's parts too: posted behind the first, they would keep its engine from
                # seeing it complete (and the lanes from starting) for a whole part's copy
                o.after = [first]
        first.wakes = [lane.engine for _, lane in shares if lane is not None]
        for o in group:
            o.group = group
        rec = self._ep.recorder
        if rec.append is not None:
            rec.record(
                "lanes",
                handle.id,
                handle.op,
                plan.conn.name,
                plan.nbytes,
                None,
                f"{len(shares)} shares",
            )
        return group

    def items(
        self, obj: Any, key: str | None, offset: int
    ) -> tuple[Items, tuple[Any, ...], Offset]:
        """The (region name, tensor) pairs of a put or get, the signature of its plan and the
        offsets (a batch of triples brings its own)."""
        if type(offset) is not int or offset < 0:
            raise ValueError(
                f"offset must be a non-negative int (elements of the region), got {offset!r}"
            )
        if isinstance(obj, torch.Tensor):
            if not obj.is_contiguous() or obj.layout != torch.strided:
                check_tensor(obj)
            if key is None:
                key = self._names.get((obj.data_ptr(), obj.nbytes))
                if key is None:
                    raise ValueError(
                        "no key given and the tensor was never exposed or registered under a name; "
                        "pass key='region' or call register(tensor, name='region')"
                    )
            items: Items = ((key, obj),)
            sig: tuple[Any, ...] = (key, obj.data_ptr(), obj.nbytes, obj.dtype)
        elif isinstance(obj, (Mapping, Batch)):
            if key is not None:
                raise ValueError(
                    "key= cannot be combined with a dict; the dict's keys name the regions"
                )
            if offset:
                raise ValueError(
                    "offset= cannot be combined with a dict; put each tensor separately"
                )
            if isinstance(obj, Batch):
                items, sig = obj.items, obj.sig
                if obj.offsets is not None:
                    return items, sig, obj.offsets
            else:
                items, sig = mapping_items(obj)
        else:
            raise TypeError(
                "expected a torch.Tensor, a dict of name -> torch.Tensor or a Transport.batch(), "
                f"got {type(obj).__name__}"
            )
        return items, sig, offset

    # -- stream-ordered transfers ------------------------------------------------------------

    def stream_op(self, request: Request) -> Any:
        """Enqueue ``request`` on its stream: checked and planned now, posted by the proxy
        thread when the stream reaches it (see transport.cuda)."""
        ops = self.stream_ops()
        op, peer = request.op, request.peer
        peers = (peer,) if isinstance(peer, str) else peer_list(peer)
        items, sig, at = self.items(request.obj, request.key, request.offset)
        if ops.capturing():
            self._check_registered_for_capture(items)
        for p in peers:
            self._plans.get(op, p, items, sig, at)  # every check before anything is enqueued
        if request.timeout is not None:
            positive("timeout", request.timeout)
        posted = dataclasses.replace(request, stream=None, proxy=True)

        def start() -> Handle:
            return self.transfer(posted)

        what = f"{'put' if op == WRITE else 'get'} to {', '.join(peers)}"
        return ops.enqueue((op, peers, sig, at, request.notify), start, what, request.stream)

    def _check_registered_for_capture(self, items: Items) -> None:
        """Inside a graph capture, every tensor must be registered already: registering memory
        makes CUDA driver calls that a capture forbids, and the capture fails (or, with the
        driver's state already set up, the transfers of the replays stall)."""
        loose = [key for key, t in items if self._ep.mem.registration_of(t) is None]
        if loose:
            names = ", ".join(repr(k) for k in loose[:5]) + (" ..." if len(loose) > 5 else "")
            raise TransportError(
                f"the tensors of {names} are not registered, and a stream= transfer inside a CUDA "
                "graph capture cannot register them (registering memory calls the CUDA driver in "
                "ways a capture forbids): register them before capturing, with "
                "transport.register(tensor, name) or one run of the same call outside the capture"
            )

    def stream_ops(self) -> Any:
        """The stream machinery, created on first use; a clear error without CUDA or CuPy."""
        if self.stream is None:
            from transport.cuda import stream as cuda_stream

            why = cuda_stream.unavailable()
            if why is not None:
                raise RuntimeError(why)
            with self._ep.lock:
                if self.stream is None:
                    self.stream = cuda_stream.StreamOps()
        return self.stream

    # -- retries after a peer restart --------------------------------------------------------

    def _after_loss(
        self, lost: Op, items: Items, sig: tuple[Any, ...], offset: Offset
    ) -> Op | None:
        """A post to a peer failed because it is gone. If it has restarted under the same name,
        return an op for the new incarnation (nothing was sent to the old one), else None."""
        old = lost.plan.conn
        self._peers.on_lost(old, PeerLostError("lost while posting", old.name))
        rec = self._peers.restarted(old)
        if rec is None:
            return None
        plan = self._plans.get(lost.plan.op, old.name, items, sig, offset, claim=True)
        if len(plan.parts) != 1:
            self._plans.unclaim([plan])
            return None
        lost.handle.add_done_callback(self._unclaimer(plan))
        log.info("peer %s restarted (generation %d); retrying on it", old.name, rec.generation)
        return Op(lost.handle, plan, plan.parts[0], lost.notif, lost.deadline, lost.timeout)

    def _unclaimer(self, plan: Plan) -> Callable[[Handle], None]:
        """A done-callback that lets go of ``plan`` (claimed for a retry)."""
        return unclaimer(self._plans, plan)

    # -- closing -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Release the streams, stop the retry thread and the lanes (the first step of
        closing)."""
        self.retries.stop()
        if self.stream is not None:
            self.stream.close()  # streams waiting on a transfer are released
        self.lanes.stop()

    def close(self, error: BaseException) -> None:
        """Fail the retries still queued with ``error`` and release the lanes (every engine has
        stopped)."""
        self.retries.close(error)
        self.lanes.close()


def peer_list(peer: Iterable[str]) -> tuple[str, ...]:
    """The peers of a fan-out, checked: a non-empty list of distinct names."""
    try:
        peers = tuple(peer)
    except TypeError:
        raise TypeError(
            f"peer must be a name or a list of names, got {type(peer).__name__}"
        ) from None
    if not peers:
        raise ValueError("the list of peers is empty")
    for p in peers:
        if not isinstance(p, str):
            raise TypeError(f"peer names must be str, got {type(p).__name__}")
    if len(set(peers)) != len(peers):
        raise ValueError("a peer appears twice in the list; each peer gets one copy")
    return peers
