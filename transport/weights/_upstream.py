"""Whom a subscriber takes weight-sync messages from: its group's publisher and relays."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transport.errors import TransportError
from transport.weights._lease import GroupLeases
from transport.weights._protocol import GroupDirectory

log = logging.getLogger("transport.weights")

Handler = Callable[[str, bytes], None]

#: how often the set of senders believed without a store read is rebuilt (a publisher that lost
#: the lease, or a relay that left, stops being believed within this)
REFRESH_S = 2.0


class Upstream:
    """The senders one subscriber acts on: the holders of its group's publisher leases (one per
    rank of a sharded trainer) and the group's relays, as the store names them.

    It owns the set of senders believed without a store read (checked every :data:`REFRESH_S`:
    the leases, and the entry of each believed relay; a store that names nobody leaves it as it
    was), the group's ``world`` (how many ranks' parts make a version) and each believed
    publisher's rank (:meth:`rank_of`)
    and, per other sender, the count of its messages waiting for a check. Rules: a message from
    a believed sender is handled at once (engine thread); any other waits for a check on the
    worker (``submit``), and while one of a sender's messages waits, the later ones wait behind
    it, so a sender's messages are handled in order; a sender the store does not name as the
    publisher or a relay is refused (counted in ``refused``, logged), whatever name it gave.

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
        self._waiting: dict[str, int] = {}
        self._next_refresh = 0.0
        self.refused = 0

    def admit(self, peer: str, payload: bytes, handle: Handler) -> None:
        """Engine thread: ``handle(peer, payload)`` now, or after a check on the worker."""
        with self._lock:
            now = peer in self._believed and not self._waiting.get(peer)
            if not now:
                self._waiting[peer] = self._waiting.get(peer, 0) + 1
        if now:
            handle(peer, payload)
        else:
            self._submit(lambda: self._check_then(peer, payload, handle))

    def _check_then(self, peer: str, payload: bytes, handle: Handler) -> None:
        try:
            ok = peer in self._believed or self._is_upstream(peer)
        finally:
            with self._lock:
                left = self._waiting[peer] - 1
                if left:
                    self._waiting[peer] = left
                else:
                    del self._waiting[peer]
        if ok:
            handle(peer, payload)
            return
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ... : a flood logs little
            log.warning(
                "group %s: ignored a weight-sync message from %s (%d so far): it is neither the "
                "group's publisher nor one of its relays", self._group, peer, self.refused,
            )  # fmt: skip

    def _is_upstream(self, peer: str) -> bool:
        """Worker: whether the store names ``peer`` as the publisher or a relay (and if so, it is
        believed from now on)."""
        try:
            found = self._leases.read()
            world, leases = found.world, found.leases
            ranks = {lease.name: r for r, lease in leases.items()}
            publishers = frozenset(ranks)
            relay = peer not in publishers and self._is_relay(peer)
        except TransportError as e:
            log.info("group %s: cannot check sender %s: %s", self._group, peer, e)
            return False
        if peer not in publishers and not relay:
            return False
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
        return entry is not None and bool(entry["relay"])

    def refresh(self) -> float:
        """Worker tick: rebuild the believed set when it is due; seconds until the next."""
        now = time.monotonic()
        if now < self._next_refresh:
            return self._next_refresh - now
        self._next_refresh = now + REFRESH_S
        try:
            found = self._leases.read()
            world, leases = found.world, found.leases
            # only the relays that wrote to us: one read each, not the whole group's entries
            relays = {n for n in self._relays if self._is_relay(n)}
        except TransportError as e:
            log.info("group %s: cannot read the group's publisher and relays: %s", self._group, e)
            return REFRESH_S
        with self._lock:
            # a store that lost the group (a Redis restarted empty) names nobody: until the
            # publisher and relays write themselves back, those we knew stay believed
            if leases:
                self._ranks = {lease.name: r for r, lease in leases.items()}
                self._publishers, self.world = frozenset(self._ranks), world
            if relays or leases:
                self._relays = frozenset(relays)
            self._believed = self._publishers | self._relays
        return REFRESH_S
