"""An engine's bucket-protocol messages as they arrive, and waiting on them with an eye on peers.

The :class:`Inbox` owns the control channel ``verl/buckets`` of one Transport. Its handler runs
on the Transport's engine thread and only files messages (a message that breaks a rule, or that
belongs to an earlier update, is logged and dropped: no frame stops the engine). The one thread
that drives an update calls :meth:`Inbox.wait` with a condition over what was filed; while it
waits, it reads the heartbeat of each peer it depends on every :data:`WATCH_INTERVAL` seconds, so
a peer that died or froze ends the wait in seconds (:class:`PeerGoneError`) instead of at the
deadline.

One update at a time: :meth:`Inbox.begin` of the next update supersedes one that still runs on
this engine (an orchestrator such as verl's manager moves on at the first error it sees, while a
trainer rank may still be sending the failed update). From then on the old update's waits, posts
and checks raise :class:`UpdateSupersededError`, so it never writes a slot or a buffer of the next
one; and ``begin`` returns only once every put the old update had in flight has settled, so no
byte of it lands in a slot after the next update's first put. Every post therefore goes through
:meth:`Inbox.post`, under the same lock as the switch. Once settled, ``begin`` tells the peers this
engine writes (:class:`~.messages.Begun`); a receiver frees its slots for an update only once
every writer of it said so, which covers the other engines too: an orchestrator that does not
wait for every engine's ``init_process_group`` before the first sends cannot have a put of an
earlier update, from an engine not yet told of the next one, land in a slot of the next.

Engines begin an update at different times, so a message may come for an update this engine has
not begun yet (a ``Begun`` or a ``Free`` from a peer that began first). Such a message is kept,
up to :data:`MAX_EARLY` of them, and filed when its update begins; a message of an update begun
here before is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TypeVar

from transport import (
    Handle,
    PeerGoneError,
    TransferTimeout,
    Transport,
    TransportError,
    UpdateSupersededError,
    WireFormatError,
)
from transport.weights.buckets.messages import (
    CHANNEL,
    Begun,
    Bucket,
    Free,
    Message,
    Stop,
    decode,
    encode,
)
from transport.weights.peer_watch import PeerWatch
from transport.weights.slot_credits import SlotCredits
from transport.weights.supersession import Supersession

log = logging.getLogger(__name__)

#: how often a waiting engine reads the heartbeats of the peers it depends on
WATCH_INTERVAL = 1.0
#: messages kept for updates not begun here yet (the oldest goes first beyond this)
MAX_EARLY = 4096
#: updates begun here whose late messages are dropped, not kept as early ones
PAST_KEPT = 8
T = TypeVar("T")


class Inbox:
    """The messages of the current update, filed by kind, and the puts it has in flight (see
    the module docstring).

    Rules: :meth:`begin` starts an update (what an earlier one left is dropped, its puts in
    flight settled first, then its writes are told); the messages of an update not begun yet
    wait for it (at most :data:`MAX_EARLY`); a writer's first two buckets wait for the
    receiver's ``Free`` (no slot is assumed free); one thread at a time waits; an update's puts go through :meth:`post`
    and its code calls :meth:`check` after each await, so an update that was superseded stops;
    :meth:`close` stops listening and wakes that thread."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._cond = threading.Condition()
        self._switch = threading.Lock()  # a post and the switch to the next update
        self._flying: list[Handle] = []
        self._update: Supersession[str] = Supersession()  # the live update's token
        self.buckets: dict[tuple[str, int], Bucket] = {}
        self.credits: dict[str, SlotCredits] = {}  # by target: what it freed for which bucket
        self.stops: list[tuple[str, Stop]] = []
        self.begun: set[str] = set()  # the writers that began the live update
        self._settled: str | None = None  # the update whose begin saw every older put settle
        self._early: deque[tuple[str, Message]] = deque(maxlen=MAX_EARLY)
        self._past: deque[str] = deque(maxlen=PAST_KEPT)  # updates begun before the live one
        self._watch = PeerWatch(transport)
        self._closed = False
        self._stop = transport.core.on_control(CHANNEL, self._on_message)

    def begin(self, token: str, settle_timeout: float = 300.0, writes: Iterable[str] = ()) -> None:
        """Start update ``token``: the one before it (if it still runs) is superseded, and once
        each of its puts in flight has settled, each peer this engine ``writes`` in update
        ``token`` is told (``Begun``). TransportError when some did not settle within
        ``settle_timeout`` s (update ``token`` is begun all the same, its writes are not told,
        and the next ``begin`` waits for them again)."""
        with self._switch:
            with self._cond:
                old = self._update.begin(token)
                if old is not None and old != token:
                    self._past.append(old)
                self.buckets.clear()
                self.credits.clear()
                self.stops.clear()
                self.begun.clear()
                self._watch.forget()
                early, self._early = list(self._early), deque(maxlen=MAX_EARLY)
                for peer, msg in early:
                    if msg.token == token:
                        self._file(peer, msg)
                self._cond.notify_all()  # an old update's wait raises UpdateSupersededError
            flying, self._flying = self._flying, []
        deadline = time.monotonic() + settle_timeout
        for handle in flying:
            if not handle.settled:
                try:
                    handle.exception(max(0.0, deadline - time.monotonic()))
                except TransferTimeout:
                    break  # the others are counted below
        late = [h for h in flying if not h.settled]
        if late:
            with self._switch:
                self._flying = late + self._flying
            peers = sorted({p for h in late for p in h.peers})
            raise TransportError(
                f"{len(late)} bucket puts of update {old} to {peers} are still in flight after "
                f"{settle_timeout:g} s; update {token} cannot write while they may still land in "
                "its slots (a peer that froze: its puts fail at the engine's timeout; try again then)"
            )
        with self._switch:
            if self._update.live == token:
                self._settled = token
        self.say_begun(token, writes)

    def say_begun(self, token: str, peers: Iterable[str]) -> None:
        """Tell ``peers`` that this engine began update ``token`` (``Begun``), if its begin saw
        every put of an earlier update settle. Said again while a writer waits for a target's
        first free slot: a target that had not joined the store yet missed it."""
        if self._settled != token:
            return
        payload = encode(Begun(token))
        for peer in peers:
            try:
                self.transport.core.send_control(peer, CHANNEL, payload)
            except TransportError as e:  # said again while its first slot is waited for
                log.info("could not tell %s that update %s began: %s", peer, token, e)

    def check(self, token: str) -> None:
        """UpdateSupersededError when the engine began another update than ``token``."""
        if self._update.superseded(token):
            current = self._update.live
            raise UpdateSupersededError(
                f"update {token} on {self.transport.name} was superseded by update {current} "
                "(its init_process_group came before this one ended, as verl's manager does "
                "after the first error it sees); it stopped here, and the next update writes once "
                "the puts this one had in flight have settled"
            )

    def post(self, token: str, put: Callable[[], Handle]) -> Handle:
        """Start ``put`` for update ``token`` unless it was superseded (UpdateSupersededError, nothing
        started); the handle is kept until the next :meth:`begin` has seen it settle."""
        with self._switch:
            self.check(token)
            handle = put()
            if len(self._flying) >= 256:
                self._flying = [h for h in self._flying if not h.settled]
            self._flying.append(handle)
            return handle

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._stop()

    def _on_message(self, peer: str, payload: bytes) -> None:
        try:
            msg = decode(payload)
        except WireFormatError as e:
            log.warning("dropping a bucket-protocol message from %s: %s", peer, e)
            return
        with self._cond:
            if msg.token in self._past:
                log.debug("dropping a message of an earlier update from %s: %s", peer, msg)
                return
            if self._update.superseded(msg.token):  # an update not begun here yet
                if len(self._early) == MAX_EARLY:
                    log.warning(
                        "more than %d early bucket messages: dropping the oldest", MAX_EARLY
                    )
                self._early.append((peer, msg))
                return
            self._file(peer, msg)
            self._cond.notify_all()

    def _file(self, peer: str, msg: Message) -> None:
        """(under the lock) file ``msg`` of the live update."""
        if isinstance(msg, Bucket):
            self.buckets.setdefault((peer, msg.index), msg)
        elif isinstance(msg, Free):
            self._credits(peer).grant(msg.index % 2, upto=msg.index)
        elif isinstance(msg, Begun):
            self.begun.add(peer)
        else:
            self.stops.append((peer, msg))

    def _credits(self, peer: str) -> SlotCredits:
        """(under the lock) ``peer``'s credits: none until it frees a slot (its ``Free(0)`` and
        ``Free(1)`` come once it began the update and its writers did)."""
        credits = self.credits.get(peer)
        if credits is None:
            credits = self.credits[peer] = SlotCredits()
        return credits

    def may_write(self, peer: str, index: int) -> bool:
        """Whether ``peer`` freed its slot for bucket ``index`` (slot ``index % 2``)."""
        with self._cond:
            return self._credits(peer).may_write(index % 2, index)

    def spend(self, peer: str, index: int) -> None:
        """Bucket ``index`` was posted to ``peer``: the credit it used is spent (one for a
        later bucket, already come, is kept)."""
        with self._cond:
            self._credits(peer).spend(index % 2, index)

    def _check(self, watch: Iterable[str]) -> None:
        for peer in watch:
            try:
                why = self._watch.why(peer)
            except TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                raise PeerGoneError(peer, why)

    def wait(
        self,
        ready: Callable[[], T | None],
        *,
        watch: Callable[[], Iterable[str]],
        timeout: float,
        what: str,
        token: str | None = None,
        every: Callable[[], None] | None = None,
    ) -> T:
        """Return ``ready()`` (called under the inbox's lock) once it is not None. PeerGoneError when a
        peer of ``watch()`` is gone; TransferTimeout naming ``what`` after ``timeout`` s;
        UpdateSupersededError when another update than ``token`` (if given) begins. ``every``
        runs each :data:`WATCH_INTERVAL` while it waits (a message said again)."""
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + WATCH_INTERVAL
        core = self.transport.core
        core.waiting(1)
        try:
            while True:
                with self._cond:
                    if self._closed:
                        raise TransportError(f"the engine closed while waiting for {what}")
                    if token is not None:
                        self.check(token)
                    value = ready()
                    if value is not None:
                        return value
                    now = time.monotonic()
                    if now >= deadline:
                        raise TransferTimeout(
                            f"no {what} within {timeout:g} s; raise engine_kwargs.transport."
                            "timeout if the trainer needs longer between buckets"
                        )
                    if now < next_check:
                        self._cond.wait(min(deadline, next_check) - now)
                        continue
                next_check = time.monotonic() + WATCH_INTERVAL
                self._check(watch())
                if every is not None:
                    every()
        finally:
            core.waiting(-1)
