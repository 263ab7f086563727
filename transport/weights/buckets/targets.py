"""The peers one writer sends buckets to in one update: a trainer rank's roots, a relay's children.

One mechanism for both writers: wait until each target freed the slot of a bucket (watching
their heartbeats), post the bucket to those that did, wait for the posts to land, tell them an
stop. A target that is gone, whose put fails or that stopped the update is dropped with its
reason, and the others go on. An update that the engine superseded (inbox.py) raises
UpdateSupersededError from every wait and post instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from functools import partial

import torch

from transport import Handle, PeerGoneError, Transport, TransportError, UpdateSupersededError
from transport.weights.buckets.inbox import Inbox
from transport.weights.buckets.messages import CHANNEL, Bucket, Stop, encode

log = logging.getLogger(__name__)

#: the region of a rollout worker that holds its two bucket slots
SLOTS = "verl.slots"


def tell(transport: Transport, peers: Iterable[str], stop: Stop) -> None:
    """Send ``stop`` to each of ``peers`` (one that cannot be reached is logged)."""
    payload = encode(stop)
    for peer in peers:
        try:
            transport.core.send_control(peer, CHANNEL, payload)
        except TransportError as e:
            log.info("could not tell %s that update %s stopped: %s", peer, stop.token, e)


class Targets:
    """The targets of one writer in one update, and those it dropped (name -> why).

    Rules: a bucket goes only to a target that freed its slot (:meth:`wait_free` first) and
    has not stopped (read at each post); the stops of the update are read once each
    (:meth:`take_stops`), and a target's own stop drops it."""

    def __init__(
        self,
        transport: Transport,
        inbox: Inbox,
        token: str,
        peers: Iterable[str],
        timeout: float,
        who: str,
    ) -> None:
        self.transport = transport
        self.inbox = inbox
        self.token = token
        self.peers = list(peers)
        self.timeout = timeout
        self.who = who
        self.dropped: dict[str, str] = {}
        self.whole: tuple[str, Stop] | None = None
        self._stops_read = 0

    def drop(self, peer: str, why: str) -> None:
        if peer in self.peers:
            self.peers.remove(peer)
            self.dropped[peer] = why
            log.warning("%s drops %s: %s", self.who, peer, why)

    def take_stops(self) -> list[tuple[str, Stop]]:
        """The stops that came since the last call; each target among their senders is dropped,
        and the first that says the whole update is lost is kept (``whole``)."""
        new = self.inbox.stops[self._stops_read :]
        self._stops_read += len(new)
        for peer, stop in new:
            self.drop(peer, f"it stopped the update: {stop.reason}")
            if stop.whole and self.whole is None:
                self.whole = (peer, stop)
        return new

    def _over(self, waiting: list[str], index: int) -> bool | None:
        """(under the inbox's lock) every one of ``waiting`` freed its slot, or a stop came."""
        if len(self.inbox.stops) > self._stops_read:
            return True
        return True if all(self.inbox.may_write(p, index) for p in waiting) else None

    async def wait_free(self, index: int) -> None:
        """Wait until each target freed its slot for bucket ``index`` or was dropped; returns
        early when a stop comes (read it with :meth:`take_stops`)."""
        self.take_stops()
        waiting = [p for p in self.peers if not self.inbox.may_write(p, index)]
        if not waiting:
            return
        try:
            await asyncio.to_thread(
                partial(
                    self.inbox.wait,
                    partial(self._over, waiting, index),
                    watch=partial(list, waiting),
                    timeout=self.timeout,
                    what=f"free slot for bucket {index} at {', '.join(waiting)}",
                    token=self.token,
                    every=partial(self._say_begun, waiting, index),
                )
            )
        except UpdateSupersededError:
            raise
        except PeerGoneError as e:
            self.drop(e.peer, e.why)
        except TransportError as e:
            for peer in waiting:
                if not self.inbox.may_write(peer, index):
                    self.drop(peer, str(e))

    def _say_begun(self, waiting: list[str], index: int) -> None:
        """While the first buckets wait: say ``Begun`` again to the targets that freed no slot
        (one that joined the store after this engine began the update missed it)."""
        if index < 2:
            silent = [p for p in waiting if not self.inbox.may_write(p, index)]
            self.inbox.say_begun(self.token, silent)

    def post(self, src: torch.Tensor, msg: Bucket, bucket_bytes: int) -> list[tuple[str, Handle]]:
        """Put ``src`` into slot ``msg.slot`` of each target that freed it, ``msg`` its
        notification; the handles, to :meth:`land`. UpdateSupersededError (nothing posted) when the
        engine began another update."""
        payload = encode(msg)
        core = self.transport.core
        self.take_stops()
        out = []
        for peer in list(self.peers):
            if not self.inbox.may_write(peer, msg.index):
                continue
            put = partial(
                core.put_control_at,
                src,
                SLOTS,
                msg.slot * bucket_bytes,
                peer,
                CHANNEL,
                payload,
                self.timeout,
            )
            try:
                out.append((peer, self.inbox.post(self.token, put)))
                self.inbox.spend(peer, msg.index)
            except UpdateSupersededError:
                raise
            except TransportError as e:
                self.drop(peer, f"its bucket put failed ({type(e).__name__}: {e})")
        return out

    async def land(self, flying: list[tuple[str, Handle]]) -> None:
        """Wait for the puts of :meth:`post`; a target whose put failed is dropped."""
        for peer, handle in flying:
            try:
                await handle
            except TransportError as e:
                self.drop(peer, f"its bucket put failed ({type(e).__name__}: {e})")


__all__ = ["SLOTS", "Targets", "tell"]
