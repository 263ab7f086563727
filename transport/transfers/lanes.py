"""Lanes: extra NIXL agents of one Transport, each posting from its own thread.

One agent copies no faster with more threads or descriptors (CMA: the copy runs inside the post,
under the agent's lock, so one at a time); two agents posting halves from two threads copy in
parallel, and faster (see benchmarks/README.md).
A transfer of at least ``lane_bytes`` is cut by bytes into one share per lane: share 0 on the
Transport's own agent, the others on the lanes. All the shares' parts form one group (one failure
fails the handle and withdraws the rest). Share 0 begins with a small part that goes alone (every
other part waits for it: a restarted peer is found before anything else is posted, and the whole
transfer is re-planned on it) and ends with a small part carrying the notification, posted only
once every other part of every share has landed; both are small so that the lanes idle only
briefly at either end. Receivers see nothing new: lanes never send notifications and are never
published.

Lanes start on the first transfer that needs them; each registers the local memory it sends
from (a cache like the Transport's) and loads the peers it writes to.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

import transport.backends as _backends
from transport.memory.local import LocalMemory
from transport.peers.conn import PeerConn
from transport.progress_engine import ProgressEngine
from transport.transfers.plan import Plan
from transport.wire import agent_name

if TYPE_CHECKING:
    from transport.backends.base import Backend
    from transport.shared_state import SharedState
    from transport.transfers.batch import Items

log = logging.getLogger(__name__)

# The first and last parts of a cut transfer: the first is posted before every other part and the
# last after them, each alone, so they are small (with 64 MiB parts the lanes idled for a
# noticeable share of a 1 GiB transfer at each end; see benchmarks/README.md).
EDGE_BYTES = 256 << 10


def default_lanes() -> int:
    """Agents per Transport for large transfers: ``$TRANSPORT_LANES``, or one per two cores, at
    least 2 (two agents already copy faster than one on a 2-core machine; see
    benchmarks/README.md) and at most 4."""
    env = os.environ.get("TRANSPORT_LANES", "").strip()
    if env:
        if not env.isdigit() or not 1 <= int(env) <= 16:
            raise ValueError(f"TRANSPORT_LANES must be a count from 1 to 16, got {env!r}")
        return int(env)
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class Lane:
    """One extra agent of a Transport: its own backend (agent ``<agent>.laneN``), engine thread,
    registrations (``mem``) and connections, started on the first transfer that needs lanes and
    closed with the Transport, after every engine has stopped.

    ``conns`` holds one connection per peer, to the incarnation the Transport's own connection
    reaches (``lock`` guards the map); :meth:`conn` and ``mem`` are used under the lane set's lock
    (by :func:`split`). Its engine posts and polls its shares and wakes the Transport's engine as
    each part ends; a lost peer closes only the lane's connection (its shares are cut again on the
    next transfer). It never publishes a record, drops every notification and retries nothing: a
    failed part fails its whole group.
    """

    def __init__(self, backend: Backend, name: str, idle_interval: float) -> None:
        self.backend = backend
        self.mem = LocalMemory(backend)
        self.engine = ProgressEngine(
            backend, name, lambda n: None, self._on_lost, None, idle_interval
        )
        self.conns: dict[str, PeerConn] = {}
        self.lock = threading.Lock()
        self.engine.start()

    def _on_lost(self, conn: PeerConn, error: BaseException) -> None:
        conn.close(self.backend)

    def conn(self, main: PeerConn) -> PeerConn:
        """This lane's connection to the incarnation ``main`` is connected to."""
        with self.lock:
            c = self.conns.get(main.name)
            if c is not None and c.alive and c.generation == main.generation:
                return c
            if c is not None:
                c.close(self.backend)
            loaded = self.backend.add_peer(main.record.metadata)
            c = self.conns[main.name] = PeerConn(
                main.record, loaded, traffic=main.traffic, ring=main.ring
            )
            return c

    def close(self) -> None:
        self.engine.stop()
        with self.lock:
            for c in self.conns.values():
                c.close(self.backend)
            self.conns.clear()
        self.mem.close()
        self.backend.close()


class LaneSet:
    """The lanes of one Transport: started together on the first transfer that needs them (as
    many as ``settings.lanes`` says then, less the Transport's own agent), stopped and closed with
    the Transport.

    It owns the list of lanes; ``lock`` guards starting them and cutting a plan over them
    (:meth:`split`). Each lane's engine wakes the Transport's engine as each part ends.
    """

    def __init__(self, ep: SharedState) -> None:
        self._ep = ep
        self.lock = threading.Lock()
        self.lanes: list[Lane] = []

    def split(self, plan: Plan, items: Items) -> list[tuple[Plan, Lane | None]]:
        """``plan`` cut over the lanes (started now if need be): see :func:`split`."""
        with self.lock:
            if not self.lanes:
                self._start()
            return split(plan, self.lanes, self._ep.backend, items)

    def _start(self) -> None:
        ep = self._ep
        base = agent_name(ep.name, ep.generation)
        for i in range(1, ep.settings.lanes):
            backend = _backends.new_backend(ep.backend_kind, agent_name=f"{base}.lane{i}")
            lane = Lane(backend, f"{ep.name}-lane{i}", ep.engine.idle_interval)
            lane.engine.on_finish = ep.engine.wake
            self.lanes.append(lane)

    def stop(self) -> None:
        """Stop every lane's engine (their transfers fail with ClosedError)."""
        for lane in self.lanes:
            lane.engine.stop()

    def close(self) -> None:
        """Release every lane (after every engine has stopped)."""
        with self.lock:
            lanes, self.lanes = self.lanes, []
        for lane in lanes:
            lane.close()


def cut(local: np.ndarray, remote: np.ndarray, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` shares of about equal bytes of paired descriptor rows (address, bytes, device);
    a row is cut where a share ends."""
    total = int(local[:, 1].sum())
    target = -(-total // n)
    shares: list[tuple[list[Any], list[Any]]] = [([], [])]
    room = target
    for lrow, rrow in zip(local.tolist(), remote.tolist(), strict=True):
        la, size, ldev = lrow
        ra, _, rdev = rrow
        while size > 0:
            if room == 0 and len(shares) < n:
                shares.append(([], []))
                room = target
            take = size if len(shares) == n else min(size, room)
            shares[-1][0].append((la, take, ldev))
            shares[-1][1].append((ra, take, rdev))
            la, ra, size, room = la + take, ra + take, size - take, room - take
    return [
        (np.array(lo, dtype=np.uint64), np.array(re, dtype=np.uint64)) for lo, re in shares if lo
    ]


def split(
    plan: Plan, lanes: list[Lane], main_backend: Backend, items: Items
) -> list[tuple[Plan, Lane | None]]:
    """The plan's shares: (share 0 on the Transport's agent, then one per lane); cached on the plan."""
    if plan.shares is not None:
        if all(s.valid for s in plan.shares):
            return list(zip(plan.shares, [None, *lanes], strict=False))
        old, plan.shares = plan.shares, None  # a lane lost its connection: cut again
        for s in old:
            with s.conn.lock:
                s.conn.plans.discard(s)
            s.release(s.backend)
    rows = plan.rows
    device, rdevice, chunk = rows.device, rows.remote_device, rows.chunk_bytes
    shares = cut(rows.local, rows.remote, len(lanes) + 1)
    out: list[tuple[Plan, Lane | None]] = []
    try:
        for i, (lo, re) in enumerate(shares):
            if i == 0:
                # a small first part goes alone (it finds a restarted peer before anything else
                # is posted, and holds the lanes back only briefly); a small last part carries
                # the notification (posted once every other part landed, so nothing else runs
                # beside it)
                size = int(lo[:, 1].sum())
                edge = min(EDGE_BYTES, size // 3)
                p = Plan(
                    main_backend,
                    plan.conn,
                    plan.op,
                    lo,
                    re,
                    device,
                    rdevice,
                    chunk,
                    plan.keep,
                    edge,
                    edge,
                )
                for reg in plan.keep:
                    reg.users += 1
                out.append((p, None))
                continue
            lane = lanes[i - 1]
            keep = lane.mem.acquire_all([t for _, t in items])
            conn = lane.conn(plan.conn)
            p = Plan(lane.backend, conn, plan.op, lo, re, device, rdevice, chunk, keep)
            with conn.lock:
                conn.plans.add(p)
            out.append((p, lane))
    except BaseException:
        for made, _ in out:
            with made.conn.lock:
                made.conn.plans.discard(made)
            made.release(made.backend)
        raise
    plan.shares = [p for p, _ in out]
    return out
