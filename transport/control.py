"""The control channel: notifications in and out, and the routing of the library's own messages."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from transport.contract import ControlHandler
from transport.errors import (
    PeerLostError,
    SignatureError,
    StoreError,
    TransferTimeout,
    WireFormatError,
)
from transport.peers.senders import HOLD_S, REFUSE_S, Senders
from transport.peers.table import PeerTable
from transport.security.sealing import FrameOpener
from transport.shared_state import SharedState, State
from transport.wire import (
    TAG_CONTROL,
    check_name,
    frame_control,
    frame_user_notification,
    parse_notification,
    peer_of_agent,
)

log = logging.getLogger(__name__)

#: user notifications held until read, in count and in payload bytes; past either, the newest
#: are dropped (and counted, and logged), so a peer flooding us cannot grow our memory unbounded
MAX_QUEUED_NOTIFICATIONS = 1 << 16
MAX_QUEUED_BYTES = 64 << 20


@dataclass(frozen=True)
class Notification:
    """A notification received from a peer: who sent it and the payload passed as ``notify=``."""

    peer: str
    payload: bytes


class ControlChannel:
    """Everything one Transport sends or receives without data: user notifications and the
    control messages of the library's own layers (weights/, withdrawals).

    It owns the handler registry (one handler per channel: a second is refused with ValueError;
    :meth:`on_control` returns the call that unregisters it) and the queue of user notifications,
    bounded by ``max_queued`` notifications and ``max_queued_bytes`` of payload (beyond either
    the newest are dropped, counted in ``dropped`` and logged, so a peer cannot grow our memory
    without bound; frames over the size limit are dropped on receipt). Threads: :meth:`route` runs on the engine thread, calls handlers
    there (a handler's exception is logged, never kills the engine) and never blocks; the waits
    (:meth:`wait`, :meth:`iterate`) are bounded by their deadline and end when the Transport
    closes (:meth:`close` wakes them). A notification is sent after every transfer completed to
    that peer before the call (the backend keeps that order).
    """

    def __init__(
        self,
        ep: SharedState,
        peers: PeerTable,
        max_queued: int = MAX_QUEUED_NOTIFICATIONS,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self._ep = ep
        self._peers = peers
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.dropped = 0  # notifications dropped because the queue was full
        self._queued_bytes = 0
        self._handlers: dict[str, ControlHandler] = {}
        self._handlers_lock = threading.Lock()
        self._queue: deque[Notification] = deque()
        self._cond = threading.Condition()
        self.refused = 0  # frames refused: unknown or unproven sender, bad MAC, replay
        keys = ep.keys
        self._opener = FrameOpener(keys, ep.agent) if keys is not None else None
        self._senders = Senders()
        self._heard: dict[str, tuple[int, float]] = {}  # see heard()

    # -- the library's own messages ----------------------------------------------------------

    def on_control(self, channel: str, handler: ControlHandler) -> Callable[[], None]:
        """Route control messages of ``channel`` to ``handler(peer, payload)`` (on the engine
        thread); returns the call that stops it. One handler per channel."""
        with self._handlers_lock:
            if channel in self._handlers:
                raise ValueError(
                    f"control channel {channel!r} already has a handler on this Transport (a "
                    "second weight publisher or subscriber of one group?); close the first"
                )
            self._handlers[channel] = handler

        def stop() -> None:
            with self._handlers_lock:
                if self._handlers.get(channel) is handler:
                    del self._handlers[channel]

        return stop

    def send_control(self, peer: str, channel: str, payload: bytes) -> None:
        self.send(peer, frame_control(channel, payload))

    def notify(self, peer: str, payload: bytes) -> None:
        self.send(peer, frame_user_notification(payload))

    def send(self, peer: str, frame: bytes) -> None:
        """Send one framed notification to ``peer`` (connecting first if needed)."""
        self._ep.check_open()
        check_name("peer name", peer)
        conn = self._peers.get(peer)
        if conn is None or not conn.alive:
            conn = self._peers.connect(peer)
        backend = self._ep.backend
        with conn.lock:
            if not conn.alive:
                raise PeerLostError(
                    f"peer {peer!r} was lost; the next call reconnects if it has restarted", peer
                )
            try:
                backend.send_notif(conn.agent, conn.seal(frame), peer)
            except PeerLostError:
                lost = True
            else:
                lost = False
                conn.ring()
                self._ep.engine.touch()
        if lost:
            conn.close(backend)
            raise PeerLostError(f"peer {peer!r} was lost while notifying it", peer)

    # -- incoming (engine thread) ------------------------------------------------------------

    def route(self, notifs: dict[str, list[bytes]]) -> None:
        """The engine's notifications: control messages to their handlers, the rest queued.

        Who sent a frame is never taken from the frame: with a secret, its MAC proves the sender
        agent (name and generation) and the frame is refused otherwise; without one, the agent
        must be the one a live connection of ours reaches, or the one the sender's record in the
        store names, checked off this thread by :meth:`check_senders` (its frames wait, in order).
        """
        out: list[Notification] = []
        if self._senders.releasable:  # held frames of senders proven since: before any newer
            for released in self._senders.release():
                who = peer_of_agent(released.agent)
                if who is not None:
                    ago = time.monotonic() - released.arrived
                    self._hear(*who, released.frames, time.time() - ago)
                    self._deliver(who[0], released.frames, out)
        for agent, frames in notifs.items():
            try:
                self._route_agent(agent, frames, out)
            except Exception:  # a bug of ours on one sender's frames: the others still count
                log.exception("dropping %d notifications from %r", len(frames), agent[:80])
                self.refused += len(frames)
        if out:
            self._enqueue(out)

    def _route_agent(self, agent: str, frames: list[bytes], out: list[Notification]) -> None:
        who = peer_of_agent(agent)
        if who is None:
            self._refuse(len(frames), f"from unknown agent {agent[:80]!r}")
            return
        peer, generation = who
        if self._opener is not None:
            frames = self._open(agent, peer, frames)
        elif self._senders.holding(agent) or not self._trusted(agent, peer):
            now = time.monotonic()
            if self._senders.refused(agent, now):
                self._refuse(len(frames), f"from agent {agent[:80]!r}, refused lately")
                return
            new = not self._senders.holding(agent)
            refused = self._senders.hold(agent, frames, now)
            if refused:
                self._refuse(refused, f"from {agent[:80]!r}: too many wait to be checked")
            if new:  # checked at once; held ones are checked again by the housekeeping rounds
                self._ep.wake.set()
            return
        self._hear(peer, generation, frames)
        self._deliver(peer, frames, out)

    def _open(self, agent: str, peer: str, frames: list[bytes]) -> list[bytes]:
        assert self._opener is not None
        opened = []
        for frame in frames:
            try:
                opened.append(self._opener.open(agent, frame))
            except SignatureError as e:
                self._refuse(1, f"from {peer}: {e}")
        return opened

    def _trusted(self, agent: str, peer: str) -> bool:
        conn = self._peers.get(peer)
        if conn is not None and conn.alive and conn.agent == agent:
            return True
        return self._senders.known(agent)

    def heard(self, peer: str, generation: int) -> float | None:
        """When (wall time, as a heartbeat says it) the last frame of incarnation ``generation``
        of ``peer`` arrived, proven to be its own (a frame held until its sender was proven
        counts from when it arrived); None if none did."""
        got = self._heard.get(peer)
        return got[1] if got is not None and got[0] == generation else None

    def _hear(
        self, peer: str, generation: int, frames: list[bytes], at: float | None = None
    ) -> None:
        if not frames:
            return
        when = time.time() if at is None else at
        got = self._heard.get(peer)
        if got is None or got[0] != generation or got[1] < when:  # one entry per proven name
            self._heard[peer] = (generation, when)

    def _deliver(self, peer: str, frames: list[bytes], out: list[Notification]) -> None:
        rec = self._ep.recorder
        for frame in frames:
            try:
                tag, channel, payload = parse_notification(frame)
            except WireFormatError as e:
                log.warning("dropping a notification from %s: %s", peer, e)
                continue
            rec.record("notif", 0, channel or "", peer, len(payload))
            if tag == TAG_CONTROL:
                self._dispatch(peer, channel or "", payload)
            else:
                out.append(Notification(peer, payload))

    def check_senders(self) -> None:
        """Housekeeping (without a secret): look up each agent whose frames wait; if its peer's
        record in the store names that agent, or the store shows that this very incarnation
        closed since (no record, and its ``left`` mark: what it sent before it went is its own,
        and a put it was told had landed keeps its notification), its frames are released to
        the engine thread, which delivers them in order before any later frame of it. If the
        record names another agent they are dropped, saying why, and that agent's frames are
        refused on receipt for ``REFUSE_S``; if the store has no record of it (or cannot be
        read), they wait, asked again once a heartbeat interval, for ``HOLD_S``. Nothing is
        delivered on this thread (``senders.Senders`` bounds what all this costs)."""
        proven = False
        senders = self._senders
        now = time.monotonic()
        for agent in senders.due(now, self._ep.settings.heartbeat_interval):
            who = peer_of_agent(agent)
            assert who is not None  # route held only parseable agents
            try:
                verdict, final = self._verdict(agent, *who)
            except (StoreError, WireFormatError) as e:
                verdict, final = f"whose record cannot be read ({e})", False
            if not verdict:
                senders.prove(agent)
                proven = True
            elif final:  # the store shows someone else: refused, and on receipt for a while
                self._refuse(
                    senders.forget(agent, now + REFUSE_S), f"from agent {agent[:80]!r} {verdict}"
                )
            elif senders.expired(agent, now):
                self._refuse(
                    senders.forget(agent), f"from agent {agent[:80]!r} {verdict} ({HOLD_S:g} s)"
                )
        if proven:
            self._ep.engine.wake()

    def _verdict(self, agent: str, peer: str, generation: int) -> tuple[str, bool]:
        """Why ``agent`` is not incarnation ``generation`` of ``peer`` as the store knows it
        ("" when it is), and whether that is final: a record that names another agent is; no
        record may be a store that restarted empty (the owner puts it back within a heartbeat).
        An incarnation that closed counts only while no newer one has a record: the layers name
        peers, not incarnations, and must not take an old one's messages for the new one's."""
        directory = self._ep.directory
        rec = directory.fetch(peer)
        if rec is not None and rec.agent == agent:
            return "", True
        if rec is not None:
            return f"that is not peer {peer!r} as the store knows it ({rec.agent})", True
        if directory.left(peer) == generation:
            return "", True
        return f"whose peer {peer!r} has no record in the store", False

    @property
    def releasable(self) -> bool:
        """Frames of senders proven since the engine last routed wait to be delivered."""
        return self._senders.releasable

    def _refuse(self, count: int, why: str) -> None:
        self.refused += count
        before = self.refused - count
        if before == 0 or before.bit_length() < self.refused.bit_length():
            log.warning("refused %d notifications (%d in all) %s", count, self.refused, why)

    def _dispatch(self, peer: str, channel: str, payload: bytes) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            log.debug("dropping a %r control message from %s: no handler", channel, peer)
            return
        try:
            handler(peer, payload)
        except Exception:  # a layer's handler must not kill the engine
            log.exception("the %r control handler failed on a message from %s", channel, peer)

    def _enqueue(self, out: list[Notification]) -> None:
        with self._cond:
            kept = 0
            for n in out:
                if (
                    len(self._queue) >= self.max_queued
                    or self._queued_bytes + len(n.payload) > self.max_queued_bytes
                ):
                    break
                self._queue.append(n)
                self._queued_bytes += len(n.payload)
                kept += 1
            if kept:
                self._cond.notify_all()
            lost = len(out) - kept
            before, self.dropped = self.dropped, self.dropped + lost
        # logged at the first drop, then each time the count doubles: a flood costs a few lines
        if lost and (before == 0 or before.bit_length() < self.dropped.bit_length()):
            log.warning(
                "dropped %d notifications (%d in all): %d of %d bytes are queued unread, the "
                "most this Transport holds; read them with notifications() or wait_notification()",
                lost,
                self.dropped,
                len(self._queue),
                self._queued_bytes,
            )

    # -- reading (user threads) --------------------------------------------------------------

    def iterate(self, timeout: float | None) -> Iterator[Notification]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._queue and not self._await(deadline):
                    return
                n = self._queue.popleft()
                self._queued_bytes -= len(n.payload)
            yield n

    def wait(self, timeout: float | None, peer: str | None) -> Notification:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for i, n in enumerate(self._queue):
                    if peer is None or n.peer == peer:
                        del self._queue[i]
                        self._queued_bytes -= len(n.payload)
                        return n
                self._ep.check_open()
                if not self._await(deadline, after=len(self._queue)):
                    self._ep.check_open()
                    who = f" from {peer!r}" if peer else ""
                    raise TransferTimeout(f"no notification{who} arrived within {timeout:.3g} s")

    def _await(self, deadline: float | None, after: int = 0) -> bool:
        """With ``_cond`` held: wait until more than ``after`` notifications are queued. False at
        the deadline or when the Transport closes."""
        engine = self._ep.engine
        engine.waiting(+1)
        try:
            while len(self._queue) <= after:
                if self._ep.state is not State.OPEN:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))  # notified too
            return True
        finally:
            engine.waiting(-1)

    def close(self) -> None:
        """Wake every reader (the Transport is closed: they return or raise ClosedError)."""
        with self._cond:
            self._cond.notify_all()
