"""Which peers of weight sync are suspect now: the one judgment both protocols make of the peers
they wait on (a weight group's subscribers, relays and trainer ranks; the bucket protocol's
targets, parents and trainer ranks).

Each peer is judged as an incarnation: by the generation the caller knows it by (a group
member's entry says it), or else by the one it had when first watched, so that a peer that
restarted under the same name counts as gone rather than as the same peer. The judgment is the
core's (``transport.core.suspect``: one heartbeat read, transport/peers/liveness.py); a peer
that left the store is named with that reason, and a store that cannot be read raises, for the
caller to judge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from transport import PeerNotFoundError, Transport


class PeerWatch:
    """Owns the generation it first saw of each peer it watched without being told one; it
    reads the store once per peer and judgment (a caller watching while it waits judges at most
    every second or so). :meth:`forget` lets go of those generations (a new update's peers)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._generations: dict[str, int] = {}

    def forget(self) -> None:
        self._generations.clear()

    def why(self, peer: str, generation: int | None = None) -> str:
        """Why ``peer`` (the incarnation of ``generation``, or the first one seen) is suspect
        now; "" when it is not. TransportError (a StoreError, a failed connect) when that
        cannot be read: the caller decides what an unreadable heartbeat means."""
        core = self.transport.core
        if generation is None:
            generation = self._generations.get(peer)
        if generation is None:
            try:
                generation = self._generations[peer] = core.peer(peer).generation
            except PeerNotFoundError:
                return "it left the store (its record is gone)"
        return core.suspect(peer, generation) or ""

    def suspects(self, peers: Iterable[str] | Mapping[str, int]) -> dict[str, str]:
        """Why each suspect one of ``peers`` is suspect (names, or names with the generation
        each is known by); TransportError as :meth:`why`."""
        known = peers if isinstance(peers, Mapping) else dict.fromkeys(peers)
        out = {}
        for peer, generation in known.items():
            why = self.why(peer, generation)
            if why:
                out[peer] = why
        return out
