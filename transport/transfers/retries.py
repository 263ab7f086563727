"""Retries of transfers whose peer restarted: the thread that re-plans them on the new incarnation."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from transport.handle import Handle
from transport.peers.table import PeerTable
from transport.progress_engine import QUEUED, Op
from transport.shared_state import SharedState, State
from transport.transfers.plan import Plan
from transport.transfers.plan_cache import PlanCache

log = logging.getLogger(__name__)


def unclaimer(plans: PlanCache, plan: Plan) -> Callable[[Handle], None]:
    """A done-callback that lets go of ``plan`` (claimed for a retry)."""
    return lambda _: plans.unclaim([plan])


class Retries:
    """The transfers of one Transport whose first post found their peer gone, and the thread
    ``transport-retry-<name>`` that re-plans each on the peer's new incarnation or fails it with
    the loss it met.

    It owns the queue (filled by the engine thread through :meth:`on_retry`) and the thread
    (started on the first retry, ended by :meth:`stop`). Rules: a retry happens only when nothing
    of the transfer reached the old incarnation; the store is asked whether the peer restarted
    for at most ``peer_table.RESTART_LOOKUP_S`` (a store that hangs never holds back a loss the
    backend reported); the thread is not housekeeping's, which a store that is down can hold up
    in its heartbeats; :meth:`close` fails whatever is still queued.
    """

    def __init__(self, ep: SharedState, peers: PeerTable, plans: PlanCache) -> None:
        self._ep = ep
        self._peers = peers
        self._plans = plans
        self._queue: deque[tuple[list[Op], BaseException]] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None  # started on the first retry

    def on_retry(self, group: list[Op], error: BaseException) -> None:
        """Engine thread: a transfer's first post found its peer gone. The retry thread re-plans
        it (a thread of its own: housekeeping may be held up by a store that is down, and the
        caller must hear of a loss the backend reported without waiting on the store)."""
        self._queue.append((group, error))
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"transport-retry-{self._ep.name}", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        ep = self._ep
        while True:
            self._wake.wait()
            self._wake.clear()
            if ep.stopping.is_set():
                return
            try:
                self.run_retries()
            except Exception:  # a bug: the transfers left are failed at close
                log.exception("transport %s: retrying transfers failed", ep.name)

    def run_retries(self) -> None:
        """The retry thread: re-plan each transfer to restart on its peer's new incarnation, or
        fail it with the loss it met."""
        ep = self._ep
        while self._queue:
            group, error = self._queue.popleft()
            first = group[0]
            old = first.plan.conn
            self._peers.on_lost(old, error)
            new_ops: list[Op] = []
            try:
                rec = self._peers.restarted(old)
                if rec is not None and ep.state is State.OPEN:
                    items, sig, offset = first.retry
                    plan = self._plans.get(first.plan.op, old.name, items, sig, offset, claim=True)
                    first.handle.add_done_callback(unclaimer(self._plans, plan))
                    notif = next((o.notif for o in group if o.notif), b"")
                    new_ops = [
                        Op(first.handle, plan, part, b"", first.deadline, first.timeout)
                        for part in plan.parts
                    ]
                    new_ops[-1].notif = notif
                    if notif and len(new_ops) > 1:
                        new_ops[-1].after = new_ops[:-1]
                    for o in new_ops:
                        o.group = new_ops
                    log.info(
                        "peer %s restarted (generation %d); retrying on it",
                        old.name,
                        rec.generation,
                    )
            except Exception as e:  # the store or the new peer failed us: report the loss
                log.warning("could not retry a transfer to %s: %s", old.name, e)
                new_ops = []
            if new_ops:
                first.handle.resize(len(new_ops) - len(group))
                ep.engine.submit(new_ops)
            else:
                self._fail(group, error)

    def _fail(self, group: list[Op], error: BaseException) -> None:
        for o in group:
            o.state = QUEUED
            self._ep.engine.fail(o, error)

    def stop(self) -> None:
        """End the thread (``ep.stopping`` is set)."""
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def close(self, error: BaseException) -> None:
        """Fail the retries still queued with ``error`` (every engine has stopped)."""
        while self._queue:
            self._fail(self._queue.popleft()[0], error)
