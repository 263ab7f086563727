"""What the publisher does with a relay's children when the relay reports, is cut off or is
gone: :class:`Handover`."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from transport import PeerLostError, TransportError
from transport.weights.group.messages import Report
from transport.weights.publishing.delivery import EXCLUDED, Delivery
from transport.weights.publishing.members import Fence, PublisherMember

log = logging.getLogger(__name__)


class Handover:
    """The part of :class:`WeightPublisher` that gives a child's slot back to the publisher
    from the relay that was to write it. It owns no state: the members' (``relay``, ``busy``,
    ``relay_handle``, ``fenced``, ``waiting``) are the publisher's, changed under its lock.

    Rules: a slot given to a relay is the relay's until it reports on it (:meth:`_on_relayed`)
    or is gone (:meth:`_release_children`: it left, was lost, or a newer incarnation of its
    name replaced it); a relay that is cut off (suspect) keeps its slot fenced, since what it
    posted may still land, and the publisher writes the child itself into the slot the child
    lends (:meth:`_close_gap`), for the version in flight or a newer one waiting: a child that
    is alive and idle never waits out a deadline for a relay that is not.
    """

    group: str
    _subs: dict[str, PublisherMember]
    _lock: threading.RLock

    if TYPE_CHECKING:

        def _finished(
            self,
            sub: PublisherMember,
            slot: int,
            version: int,
            handle: Delivery,
            err: BaseException | None,
        ) -> None: ...

        def _start(
            self, sub: PublisherMember, version: int, handle: Delivery, via: str | None = None
        ) -> None: ...

        def _resume(self, sub: PublisherMember) -> None: ...

    def _release_children(self, relay: str, why: str) -> None:
        """With the lock held: the incarnation of ``relay`` that was asked to forward cannot
        write any more (it is gone: ``why``); the slots it was to write, or that stayed fenced
        for it, are the publisher's again, what it did not forward is excluded (the child is
        told the slot's version was given up), and a version waiting to go through it is
        written by the publisher."""
        for sub in list(self._subs.values()):
            sub.unfence(relay)
            if sub.waiting is not None and sub.waiting.via == relay:
                sub.waiting = dataclasses.replace(sub.waiting, via=None)
            if sub.relay == relay and sub.busy is not None and sub.relay_handle is not None:
                # (its outcome may be settled already, at its deadline: the slot stayed the
                # relay's until now)
                err = TransportError(f"relay {relay} {why} before forwarding version {sub.writing}")
                self._finished(sub, sub.busy, sub.writing, sub.relay_handle, err)

    def _close_gap(self, sub: PublisherMember, why: str) -> bool:
        """With the lock held (SuspectWatch): ``sub``'s relay became suspect while it was to
        write ``sub``. The slot it was given stays fenced (the relay may have posted into it,
        and what it posted may still land), and the publisher writes ``sub`` itself into the
        slot ``sub`` hands back on ``lend`` (its applied newest version's): the version the
        relay had, while its deadline lasts and nothing newer waits, else the newer one that
        waits (the relay's is then excluded). False when neither is left to write."""
        handle, relay, slot, version = sub.relay_handle, sub.relay, sub.busy, sub.writing
        if handle is None or relay is None or slot is None:
            return False
        sub.fenced[slot] = Fence(relay, version)
        sub.busy, sub.relay, sub.relay_handle = None, None, None
        handle.result.via.pop(sub.name, None)
        if sub.waiting is not None and sub.waiting.via == relay:
            sub.waiting = dataclasses.replace(sub.waiting, via=None)
        live = sub.name in handle.pending and handle.deadline > time.monotonic()
        if sub.waiting is None and not live:
            return False
        log.info("group %s: %s; writing %s directly", self.group, why, sub.name)
        if sub.waiting is None:
            self._start(sub, version, handle)
        else:
            handle.settle(sub.name, EXCLUDED, why)
            self._resume(sub)
        return True

    def _on_relayed(self, relay: str, report: Report) -> None:
        """A relay's report on one forward: the child's slot is the publisher's again. A
        forward that landed as changes (``report.patched``: their bytes) is in the result's
        ``patched``, as the publisher's own writes of changes are, while the version still
        waits for the child (one excluded at its deadline meanwhile stays out of it)."""
        version, child, outcome, why = report.version, report.child, report.outcome, report.why
        with self._lock:
            sub = self._subs.get(child)
            if sub is not None:
                sub.unfence(relay, version)
            if (
                sub is None
                or sub.relay != relay
                or sub.writing != version
                or sub.busy is None
                or sub.relay_handle is None
            ):
                return
            err: TransportError | None = None
            if outcome == "lost":
                err = PeerLostError(f"relay {relay} lost it: {why}", child)
            elif outcome:
                err = TransportError(f"relay {relay} could not forward version {version}: {why}")
            elif report.patched and sub.relay_handle.waits_for(child):
                sub.relay_handle.result.patched[child] = report.patched
            self._finished(sub, sub.busy, version, sub.relay_handle, err)
