"""The plan cache: prepared transfers of one Transport, by (op, peer, tensors, offset)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from transport.errors import PeerLostError, RegionError, RegistrationBudgetError
from transport.peers.conn import PeerConn
from transport.peers.table import PeerTable
from transport.shared_state import SharedState
from transport.transfers.batch import Offset
from transport.transfers.plan import Plan, build_plan

if TYPE_CHECKING:
    import torch

#: (op, peer, signature, offset): the signature names the tensors by (region, pointer, bytes,
#: dtype), so a cached plan holds no tensor
PlanKey = tuple[Any, ...]


class PlanCache:
    """The plans of one Transport, least recently made first, at most ``settings.max_plans``.

    It owns the map from :data:`PlanKey` to plan; ``lock`` guards every change, and is held while
    a plan is made (so two threads never make one plan twice); the fast paths read the map
    without it (:meth:`lookup`) and accept only a plan that is ``inline``, ``valid`` and on a live
    connection. Lock order: this lock, then the peer table's, then a connection's, then the local
    memory's. Rules: a plan in flight is never released (eviction skips it until it is idle): a
    transfer *claims* its plans (``get(..., claim=True)``) before any of its parts is posted and
    lets go (:meth:`unclaim`) once its handle completes, so a plan whose parts are still queued,
    or one made for the first peers of a fan-out wider than the cache, stays;
    plans of dropped connections are let go at the next plan made or housekeeping round
    (:meth:`purge`); plans on a region its owner withdraws stop at once (:meth:`stop_region`);
    when implicit registrations are over their bounds, idle plans pinning them are shed.
    """

    def __init__(self, ep: SharedState, peers: PeerTable) -> None:
        self._ep = ep
        self._peers = peers
        self.lock = threading.RLock()
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()
        #: the fast paths' lookup: no lock, no check (the caller checks the plan it gets)
        self.lookup = self._plans.get

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list[Plan]:
        """The cached plans, least recently made first (a snapshot)."""
        return list(self._plans.values())

    def get(
        self,
        op: str,
        peer: str,
        items: tuple[tuple[str, torch.Tensor], ...],
        sig: tuple[Any, ...],
        offset: Offset,
        claim: bool = False,
    ) -> Plan:
        """The usable plan of this transfer: the cached one, or a new one (every rule checked).
        With ``claim``, it is the caller's until :meth:`unclaim` (never evicted meanwhile)."""
        key = (op, peer, sig, offset)
        plan = self._plans.get(key)
        if plan is not None and plan.valid and plan.conn.alive and (not claim or self._claim(plan)):
            return plan
        ep, peers = self._ep, self._peers
        with self.lock:
            ep.check_open()
            self._purge()
            conn = peers.connect(peer)
            try:
                plan = self._build(op, conn, items, offset)
            except RegistrationBudgetError:
                # idle plans may pin cached registrations: let them go and try once more
                self._shed(None, everything=True)
                plan = self._build(op, conn, items, offset)
            except RegionError:
                # the peer may have exposed more since we read its record
                plan = self._build(op, peers.connect(peer, refresh=True), items, offset)
            except PeerLostError:
                if conn.alive and peers.restarted(conn) is None:
                    raise
                # the connection was dropped while the plan was made (housekeeping saw a newer
                # incarnation, or a transfer saw the peer go), or the peer restarted and its old
                # agent is gone: plan on what the store holds
                plan = self._build(op, peers.connect(peer, refresh=True), items, offset)
            plan.inline = len(plan.parts) == 1 and plan.nbytes <= ep.settings.inline_bytes
            self._plans[key] = plan
            with plan.conn.lock:
                plan.conn.plans.add(plan)
                if claim:
                    plan.claims += 1
            if ep.mem.over_limit():
                self._shed(plan)
            for _ in range(len(self._plans) - ep.settings.max_plans):
                old_key, old = next(iter(self._plans.items()))
                if not self._forget(old_key, old):  # in flight: keep it, retry later
                    self._plans.move_to_end(old_key)
        return plan

    @staticmethod
    def _claim(plan: Plan) -> bool:
        with plan.conn.lock:
            if not plan.valid:
                return False  # released or stopped since the lookup: the caller plans again
            plan.claims += 1
            return True

    @staticmethod
    def unclaim(plans: list[Plan]) -> None:
        """The transfer that claimed ``plans`` has completed (or was never posted)."""
        for plan in plans:
            with plan.conn.lock:
                plan.claims -= 1

    def _build(
        self, op: str, conn: PeerConn, items: tuple[tuple[str, torch.Tensor], ...], offset: Offset
    ) -> Plan:
        ep = self._ep
        return build_plan(ep.backend, ep.mem, conn, op, items, offset, ep.settings.chunk_bytes)

    def _forget(self, key: PlanKey, plan: Plan) -> bool:
        """With the lock held: drop a cached plan and release it, unless transfers are in flight
        on it (False then)."""
        with plan.conn.lock:
            if plan.in_flight:
                return False
            del self._plans[key]
            plan.conn.plans.discard(plan)
            plan.release(self._ep.backend)
        return True

    def _shed(self, current: Plan | None, everything: bool = False) -> None:
        """With the lock held: implicit registrations are over their limits (or, ``everything``,
        a registration would pass the budget), and plans pin them. Release the least recently made
        idle plans on implicit memory (a later put of the same tensors plans again) until
        registrations can be dropped."""
        mem = self._ep.mem
        for key, old in list(self._plans.items()):
            if not everything and not mem.over_limit():
                break
            if old is current or not any(not r.explicit for r in old.keep):
                continue
            if self._forget(key, old):
                mem.evict()

    def purge(self) -> None:
        """Let go of the plans of connections the peer table dropped (released already)."""
        with self.lock:
            self._purge()

    def _purge(self) -> None:
        dropped = self._peers.take_dropped()
        if dropped:
            gone = {id(c) for c in dropped}
            for k in [k for k, p in self._plans.items() if id(p.conn) in gone]:
                del self._plans[k]

    def stop_regions(self, conn: PeerConn, regions: tuple[str, ...], revision: int = 0) -> bool:
        """Its owner withdraws ``regions`` (its record without them is ``revision``, 0: not
        said): no plan on any of them is used again (new transfers re-plan and fail with
        RegionError), no older record of the peer is taken again, and the idle plans are
        released now. True once none is in flight."""
        gone = set(regions)
        with conn.lock:
            conn.stale_below = max(conn.stale_below, revision)
            for region in regions:
                conn.regions.pop(region, None)
            for plan in conn.plans:
                if not gone.isdisjoint(plan.regions):
                    plan.valid = False
        with self.lock:
            stopped = [(k, p) for k, p in self._plans.items() if p.conn is conn and not p.valid]
            return all([self._forget(k, p) for k, p in stopped])

    def clear(self) -> None:
        """Forget every plan (at close, after the connections released them)."""
        with self.lock:
            self._plans.clear()
