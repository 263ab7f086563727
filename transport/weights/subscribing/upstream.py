"""Whom a subscriber takes weight-sync messages from: its group's publisher and relays."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from transport import TransportError
from transport.weights.group.group_directory import GroupDirectory
from transport.weights.group.lease import GroupLeases

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]

#: how often the set of senders believed without a store read is rebuilt (a publisher that lost
#: the lease, or a relay that left, stops being believed within this), and how long a sender
#: found to be neither is refused without a store read
REFRESH_S = 2.0
#: how long a sender that could not be checked (the store failed) is refused before another try
RETRY_S = 0.5
#: how long the messages of a sender the store does not know yet are held, checked again every
#: RETRY_S: a store that restarted empty shows a relay's entry, or the publisher's lease, again
#: within a heartbeat or a publish; a version's ``ver`` dropped meanwhile would be lost for good
UNKNOWN_HOLD_S = 5.0
#: messages held while their sender is checked: per sender, and in all; past either, refused
MAX_HELD_PER_SENDER = 256
MAX_HELD = 1024
#: senders whose refusal is remembered (the oldest is forgotten first, then checked again)
MAX_REFUSED = 1024


class Upstream:
    """The senders one subscriber acts on: the holders of its group's publisher leases (one per
    rank of a sharded trainer) and the group's relays, as the store names them.

    It owns the set of senders believed without a store read (checked every :data:`REFRESH_S`:
    the leases, and the entry of each believed relay; a store that names nobody leaves it as it
    was), the group's ``world`` (how many ranks' parts make a version) and each believed
    publisher's rank (:meth:`rank_of`); the messages held, per other sender, while it is
    checked; and the senders refused lately. Rules:

    * a message from a believed sender is handled at once (engine thread);
    * any other is held and its sender checked, once, on the worker (``submit``): the store's
      leases and the sender's group entry (a few reads). While a sender's messages are held,
      its later ones are held behind them, so they are handled in order, on the worker, if the
      store names it the publisher or a relay (it is believed from then on);
    * a sender the store does not know yet (no entry of it, or no lease at all: a store that
      restarted empty and is being filled again), or that it could not be read about, keeps
      its messages held and is checked again every :data:`RETRY_S` seconds for up to
      :data:`UNKNOWN_HOLD_S` (a relay's ``ver`` dropped while its entry is missing would cost
      the version for good, though its relay reports it written);
    * a sender the store names neither is refused, whatever name it gave: its held messages
      and every message it sends for the next :data:`REFRESH_S` seconds (:data:`RETRY_S` when
      the store could not be read) are dropped at once, on the engine thread, with no store
      read and nothing queued; then it is checked again (a new publisher, or a relay whose
      entry the store lacked for a moment, is heard again). Refusals are counted in
      ``refused`` and logged (the 1st, 2nd, 4th, ... one);
    * memory is bounded: at most :data:`MAX_HELD_PER_SENDER` messages held per sender and
      :data:`MAX_HELD` in all (more are refused), one check queued per sender, at most
      :data:`MAX_REFUSED` refusals remembered. A flood from a peer that is not upstream costs one
      check (a few store reads) per :data:`REFRESH_S`, however many messages it sends.

    Senders are told apart by name: the engine hands over the name a message's sender proved
    (its MAC with a secret, its record without), not its incarnation; a refusal of a name ends
    within :data:`REFRESH_S`, so a restart under that name as the publisher is heard again then
    (a new publisher's hello is asked again every ``HELLO_AGAIN`` while it waits).

    Only what the store holds signed counts (``GroupLeases``, ``GroupDirectory.entry``): a lease
    its holder did not sign, or of an incarnation that is not the holder's live one, names no
    publisher and no world; an entry its subscriber did not sign names no relay.
    """

    def __init__(
        self,
        leases: GroupLeases,
        group: str,
        directory: GroupDirectory,
        submit: Callable[[Callable[[], object]], None],
    ) -> None:
        self._leases = leases
        self._group = group
        self._dir = directory
        self._submit = submit
        self._lock = threading.Lock()
        self._believed: frozenset[str] = frozenset()
        self._publishers: frozenset[str] = frozenset()
        self._ranks: dict[str, int] = {}  # publisher -> its rank
        self.world = 1
        self._relays: frozenset[str] = frozenset()
        self._held: dict[str, list[bytes]] = {}  # sender being checked -> its messages, in order
        self._held_count = 0
        self._refused: OrderedDict[str, float] = OrderedDict()  # sender -> refused until
        self._next_refresh = 0.0
        # senders the store did not know yet -> (when to check again, when to give up, handler)
        self._unknown: dict[str, tuple[float, float, Handler]] = {}
        self.refused = 0

    def admit(self, peer: str, payload: bytes, handle: Handler) -> None:
        """Engine thread: ``handle(peer, payload)`` now, after a check on the worker, or never."""
        check = False
        with self._lock:
            if peer in self._believed and peer not in self._held:
                now = True
            else:
                now = False
                held = self._hold(peer, payload)
                if held is None:
                    return
                check = held  # the first held: check its sender (once)
        if now:
            handle(peer, payload)
        elif check:
            self._submit(lambda: self._check(peer, handle))

    def _hold(self, peer: str, payload: bytes) -> bool | None:
        """Under the lock: hold ``payload`` while ``peer`` is checked: True if its check is to
        be queued (nothing of it was held), False if one is under way, None if it is refused."""
        until = self._refused.get(peer)
        if until is not None:
            if until > time.monotonic():
                self._refuse(peer, 1)
                return None
            del self._refused[peer]  # refused long enough: check it again
        held = self._held.get(peer)
        if self._held_count >= MAX_HELD or (held is not None and len(held) >= MAX_HELD_PER_SENDER):
            self._refuse(peer, 1, "too many of its messages wait for its check")
            return None
        first = held is None
        if held is None:
            held = self._held[peer] = []
        held.append(payload)
        self._held_count += 1
        return first

    def _check(self, peer: str, handle: Handler) -> None:
        """Worker: is ``peer`` upstream? Then its held messages are handled, in order; if the
        store does not know it yet, they stay held and it is checked again; else they are
        dropped and it is refused for a while."""
        verdict = True if peer in self._believed else self._is_upstream(peer)
        if verdict is None:
            now = time.monotonic()
            with self._lock:
                _, give_up, _ = self._unknown.get(peer, (0.0, now + UNKNOWN_HOLD_S, handle))
                if now < give_up:
                    self._unknown[peer] = (now + RETRY_S, give_up, handle)
                    return
                del self._unknown[peer]
        else:
            with self._lock:
                self._unknown.pop(peer, None)
        if verdict:
            while True:  # messages that come meanwhile are held behind these
                with self._lock:
                    frames = self._held.pop(peer, [])
                    if frames:
                        self._held[peer] = []
                    self._held_count -= len(frames)
                if not frames:
                    return
                for frame in frames:
                    handle(peer, frame)
        with self._lock:
            frames = self._held.pop(peer, [])
            self._held_count -= len(frames)
            self._refused[peer] = time.monotonic() + (REFRESH_S if verdict is False else RETRY_S)
            self._refused.move_to_end(peer)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
            self._refuse(peer, len(frames))

    def _refuse(self, peer: str, count: int, why: str = "") -> None:
        """Under the lock: ``count`` messages of ``peer`` dropped; logged the 1st, 2nd, 4th, ...
        time."""
        before = self.refused
        self.refused += count
        if count and (before == 0 or before.bit_length() < self.refused.bit_length()):
            log.warning(
                "group %s: ignored %d weight-sync message(s) from %s (%d so far): %s",
                self._group,
                count,
                peer,
                self.refused,
                why or "it is neither the group's publisher nor one of its relays",
            )

    def _is_upstream(self, peer: str) -> bool | None:
        """Worker: whether the store names ``peer`` as the publisher or a relay (and if so, it is
        believed from now on); None if the store could not be read, or does not know ``peer``
        yet (no entry of it, or no lease at all: a store filled again after a restart)."""
        try:
            found = self._leases.read(marks=True)
            world, leases = found.world, found.leases
            ranks = {lease.name: r for r, lease in leases.items()}
            publishers = frozenset(ranks)
            entry = None if peer in publishers else self._dir.entry(peer)
        except TransportError as e:
            log.info("group %s: cannot check sender %s: %s", self._group, peer, e)
            return None
        relay = entry is not None and entry.relay
        if peer not in publishers and not relay:
            return None if entry is None or not leases else False
        with self._lock:
            if peer in publishers:
                self._publishers, self._ranks, self.world = publishers, ranks, world
            else:
                self._relays = self._relays | {peer}
            self._believed = self._publishers | self._relays
        return True

    def rank_of(self, peer: str) -> int | None:
        """The rank ``peer`` publishes (None: a relay, or not a publisher)."""
        with self._lock:
            return self._ranks.get(peer)

    def _is_relay(self, peer: str) -> bool:
        """Whether the group's entry of ``peer`` says it relays (one that is not valid does not)."""
        entry = self._dir.entry(peer)
        return entry is not None and entry.relay

    def refresh(self) -> float:
        """Worker tick: check again the senders the store did not know yet when they are due;
        rebuild the believed set when it is due; seconds until the next."""
        now = time.monotonic()
        with self._lock:
            due = [(p, h) for p, (at, _, h) in self._unknown.items() if at <= now]
        for peer, handle in due:
            self._check(peer, handle)
        if now >= self._next_refresh:
            self._next_refresh = now + REFRESH_S
            self._rebuild()
        with self._lock:
            soonest = min((at for at, _, _ in self._unknown.values()), default=math.inf)
        return max(0.01, min(self._next_refresh, soonest) - now)

    def _rebuild(self) -> None:
        """Worker: the believed set from the store's leases and the entries of the relays
        believed so far."""
        try:
            found = self._leases.read(marks=True)
            world, leases = found.world, found.leases
            # only the relays that wrote to us: one read each, not the whole group's entries
            relays = {n for n in self._relays if self._is_relay(n)}
        except TransportError as e:
            log.info("group %s: cannot read the group's publisher and relays: %s", self._group, e)
            return
        with self._lock:
            # a store that lost the group (a Redis restarted empty) names nobody: until the
            # publisher and relays write themselves back, those we knew stay believed
            if leases:
                self._ranks = {lease.name: r for r, lease in leases.items()}
                self._publishers, self.world = frozenset(self._ranks), world
            if relays or leases:
                self._relays = frozenset(relays)
            self._believed = self._publishers | self._relays
