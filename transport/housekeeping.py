"""Housekeeping: the background threads of one Transport."""

from __future__ import annotations

import logging
import threading
import time

from transport.control import ControlChannel
from transport.dumps import Dumps
from transport.memory.regions import Regions
from transport.peers.table import PeerTable
from transport.shared_state import SharedState
from transport.transfers.paths import Transfers
from transport.transfers.plan_cache import PlanCache

log = logging.getLogger(__name__)

#: a heartbeat whose write took longer than this (and half an interval) is followed by another
#: at once (see ``Housekeeping._heartbeats``)
HELD_S = 0.5


class Housekeeping:
    """The threads ``transport-control-<name>`` and ``transport-heartbeat-<name>`` of one
    Transport, from :meth:`start` until the Transport closes (``ep.stopping``).

    It owns no state of its own. The heartbeat thread only writes the heartbeat, every
    ``heartbeat_interval``: nothing a peer or the store supplies is decoded there, so no record,
    however large, and no slow store read makes this Transport look gone. The control thread
    runs the other parts' slow work off the hot paths: at once when woken (``ep.wake``: senders
    of notifications to check, dumps, withdrawals), and every ``heartbeat_interval``: restoring
    our record if the store lost it, the namespace's dump requests, dropping connections to
    peers that restarted, letting go of the plans of dropped connections. Rules: it never holds
    a lock across parts; a store that is down costs a warning per round, never a thread; its
    writes of our record and heartbeat stop before the Transport leaves the namespace, and none
    lands after (``Transport.close`` retires the name in the directory first, which waits for
    the write in flight: ``Directory.retire``), so a closed peer never looks alive again.
    """

    def __init__(
        self,
        ep: SharedState,
        peers: PeerTable,
        plans: PlanCache,
        regions: Regions,
        transfers: Transfers,
        dumps: Dumps,
        control: ControlChannel,
    ) -> None:
        self._ep = ep
        self._peers = peers
        self._plans = plans
        self._regions = regions
        self._transfers = transfers
        self._dumps = dumps
        self._control = control
        self._threads = (
            threading.Thread(target=self._loop, name=f"transport-control-{ep.name}", daemon=True),
            threading.Thread(
                target=self._heartbeats, name=f"transport-heartbeat-{ep.name}", daemon=True
            ),
        )

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _heartbeats(self) -> None:
        """A heartbeat every interval. One held for long (HELD_S, or half an interval: the
        network or the store held it, a link cut, then healed) may have landed with a time
        already near the suspicion bar, so the next one goes at once, once: a peer heard again
        is never suspect again a moment later, between that late heartbeat and the next. A
        slow store (a loaded host) gets no more heartbeats than one an interval for it."""
        ep = self._ep
        interval = ep.settings.heartbeat_interval
        wait = interval
        while not ep.stopping.wait(wait):
            began = time.monotonic()
            try:
                ep.directory.heartbeat(ep.name, ep.generation)
            except Exception as e:  # the store may be down; transfers go on without it
                log.warning("transport %s: store unavailable for heartbeats: %s", ep.name, e)
            held = time.monotonic() - began > max(HELD_S, interval / 2)
            wait = 0.0 if held and wait > 0 else interval

    def _loop(self) -> None:
        ep = self._ep
        next_beat = time.monotonic() + ep.settings.heartbeat_interval
        while not ep.stopping.is_set():
            ep.wake.wait(max(0.0, next_beat - time.monotonic()))
            ep.wake.clear()
            if ep.stopping.is_set():
                break
            for step in (self._control.check_senders, self._dumps.run, self._regions.run):
                try:
                    step()
                except Exception:  # a bug, or what a peer sent: logged, the thread goes on
                    log.exception(
                        "transport %s: housekeeping step %s failed",
                        ep.name,
                        getattr(step, "__name__", step),
                    )
            if time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + ep.settings.heartbeat_interval
            try:
                self._round()
            except Exception as e:  # the store may be down; transfers go on without it
                log.warning("transport %s: store unavailable for housekeeping: %s", ep.name, e)

    def _round(self) -> None:
        ep = self._ep
        self._dumps.check_requests()
        if self._regions.restore():
            log.warning(
                "transport %s: the store had lost or replaced its record; published it again",
                ep.name,
            )
            ep.recorder.record("join", peers=ep.name, info="record restored in the store")
        self._peers.drop_restarted()
        self._plans.purge()
