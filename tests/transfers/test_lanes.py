"""Lanes: a large put or get cut over extra agents, each posting from its own thread; every byte
lands, the notification comes once after all of it, a failure fails the whole handle and leaves
nothing posted, and small transfers never start a lane."""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import transport
from helpers import internals
from helpers.peer import Peer, pattern, sha
from transport import Handle
from transport.progress_engine import FAILED, Op
from transport.transfers.lanes import EDGE_BYTES
from transport.transfers.plan import Part

MiB = 1 << 20


def nothing_in_flight(t: transport.Transport, timeout: float = 5.0) -> bool:
    """No part of any transfer queued or posted on any agent, and no plan busy. Each engine
    withdraws the parts of a failed transfer on its own thread (within a loop of it), so this
    polls until the deadline."""
    from transport.progress_engine import POSTED, QUEUED

    engines = [internals.engine(t), *(lane.engine for lane in internals.lanes(t))]
    end = time.monotonic() + timeout
    while True:
        ops = [o for e in engines for o in internals.engine_ops(e)]
        if all(o.state not in (QUEUED, POSTED) for o in ops) and all(
            p.in_flight == 0 for p in internals.plans(t)
        ):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.005)  # sync-ok: the poll interval of a deadline-bounded wait


def test_a_large_put_and_get_are_cut_over_lanes(tcp_store):
    with (
        Peer("recv", tcp_store.url, {"buf": ("uint8", 96 * MiB, "rw")}) as p,
        transport.Transport("writer", store=tcp_store, lanes=3, lane_bytes=16 * MiB) as w,
    ):
        w.wait_for_peer("recv", 30)
        src = pattern(96 * MiB, 1)
        w.put(src, "recv", "buf", notify=b"all").wait(60)
        assert len(internals.lanes(w)) == 2  # the Transport's own agent and two more
        plan = internals.plans(w)[0]
        assert plan.shares is not None and len(plan.shares) == 3
        assert sum(s.nbytes for s in plan.shares) == 96 * MiB
        # share 0 starts with a small part posted alone and ends with a small notifying one
        edges = plan.shares[0].parts[0].nbytes, plan.shares[0].parts[-1].nbytes
        assert edges == (EDGE_BYTES, EDGE_BYTES)
        agents = {internals.backend(w), *(ln.backend for ln in internals.lanes(w))}
        assert {s.backend for s in plan.shares} == agents
        peer, payload, shas = p.call("notif_then_sha", 30, ["buf"])
        assert (peer, payload) == ("writer", b"all") and shas["buf"] == sha(src)
        assert p.call("notifications", 0) == []  # one notification for the three shares
        # a READ too, into fresh memory, and a second put reusing the cut
        p.call("fill", "buf", 7)
        back = torch.zeros(96 * MiB, dtype=torch.uint8)
        w.get(back, "recv", "buf").wait(60)
        assert sha(back) == p.call("sha", "buf")
        src2 = pattern(96 * MiB, 2)
        src.copy_(src2)
        w.put(src, "recv", "buf").wait(60)
        assert p.call("sha", "buf") == sha(src2)
        assert nothing_in_flight(w)


def test_a_batch_to_two_receivers_over_lanes(tcp_store):
    names = [f"w{i}" for i in range(300)]
    spec = {n: ("float32", 64 * 1024, "w") for n in names}  # 300 x 256 KiB = 75 MiB
    batch = {n: torch.full((64 * 1024,), float(i)) for i, n in enumerate(names)}
    with (
        Peer("gen-0", tcp_store.url, spec) as a,
        Peer("gen-1", tcp_store.url, spec) as b,
        transport.Transport("writer", store=tcp_store, lanes=2, lane_bytes=16 * MiB) as w,
    ):
        for g in ("gen-0", "gen-1"):
            w.wait_for_peer(g, 30)
        w.put(batch, ["gen-0", "gen-1"], notify=b"v1").wait(60)
        for r in (a, b):
            _, payload, shas = r.call("notif_then_sha", 30, names)
            assert payload == b"v1" and shas == {n: sha(t) for n, t in batch.items()}


def test_a_killed_receiver_fails_the_whole_handle_and_nothing_stays_posted(tcp_store):
    p = Peer("victim", tcp_store.url, {"buf": ("uint8", 256 * MiB, "w")})
    try:
        with transport.Transport("writer", store=tcp_store, lanes=2, lane_bytes=16 * MiB) as w:
            w.wait_for_peer("victim", 30)
            src = pattern(256 * MiB, 3)
            w.put(src, "victim", "buf").wait(60)
            p.kill()
            err = w.put(src, "victim", "buf", timeout=30).exception(60)
            assert isinstance(err, transport.PeerLostError), err
            assert nothing_in_flight(w)
    finally:
        p.kill()


def test_a_frozen_receiver_times_out_the_whole_handle(tcp_store):
    with (
        Peer("frozen", tcp_store.url, {"buf": ("uint8", 64 * MiB, "w")}) as p,
        transport.Transport("writer", store=tcp_store, lanes=2, lane_bytes=16 * MiB) as w,
    ):
        w.wait_for_peer("frozen", 30)
        src = pattern(64 * MiB, 4)
        w.put(src, "frozen", "buf", notify=b"a").wait(60)
        p.signal(signal.SIGSTOP)
        try:
            err = w.put(src, "frozen", "buf", notify=b"b", timeout=1.0).exception(30)
            assert isinstance(err, transport.TransferTimeout), err
            assert nothing_in_flight(w)
        finally:
            p.signal(signal.SIGCONT)
        w.put(src, "frozen", "buf", notify=b"c").wait(60)  # and it works again
        assert p.call("sha", "buf") == sha(src)


def test_small_transfers_never_start_a_lane(tcp_store):
    with (
        Peer("recv", tcp_store.url, {"buf": ("uint8", 8 * MiB, "w")}) as p,
        transport.Transport("writer", store=tcp_store, lanes=4) as w,
    ):
        w.wait_for_peer("recv", 30)
        assert w.lane_bytes == 8 * MiB  # the default
        for i in range(5):
            w.put(pattern(8 * MiB - 4096, i), "recv", "buf").wait(30)
        assert internals.lanes(w) == []  # under lane_bytes
        tail = torch.zeros(4096, dtype=torch.uint8)  # never written
        assert p.call("sha", "buf") == sha(torch.cat([pattern(8 * MiB - 4096, 4), tail]))
        w.put(pattern(8 * MiB, 5), "recv", "buf").wait(30)
        assert len(internals.lanes(w)) == 3  # at lane_bytes: cut over the other three agents
        assert p.call("sha", "buf") == sha(pattern(8 * MiB, 5))
    with transport.Transport("one", store=tcp_store, lanes=1) as t:
        assert t.lanes == 1


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"lanes": 0}, "lanes must be"),
        ({"lanes": 17}, "lanes must be"),
        ({"lanes": True}, "lanes must be"),
        ({"lane_bytes": 4096}, "lane_bytes"),
    ],
)
def test_bad_lane_settings(tcp_store, kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        transport.Transport("bad", store=tcp_store, **kwargs)


def test_fresh_tensors_over_lanes_are_let_go_on_every_agent(tcp_store):
    """A new source tensor every put (x.clone(), say), each cut over lanes: every agent's
    registration cache stays within its limits, so the memory of dropped tensors is freed."""
    with (
        Peer("recv", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")}) as p,
        transport.Transport("writer", store=tcp_store, lanes=2, lane_bytes=MiB) as w,
    ):
        w.wait_for_peer("recv", 30)
        w.put(pattern(4 * MiB, 0), "recv", "buf").wait(30)  # starts the lane
        mems = [internals.local_memory(w), *(lane.mem for lane in internals.lanes(w))]
        assert len(mems) == 2
        for mem in mems:
            mem.max_implicit, mem.max_implicit_bytes = 8, 16 * MiB
        for i in range(1, 120):
            src = pattern(4 * MiB, i)
            w.put(src, "recv", "buf").wait(30)
            if i % 20 == 0:
                assert p.call("sha", "buf") == sha(src), f"put {i}"
                for mem in mems:
                    assert len(mem) <= 9, (mem, len(mem))
        assert p.call("sha", "buf") == sha(src)


@pytest.mark.parametrize("cause", ["timeout", "lost"])
def test_a_part_waiting_on_a_failed_part_fails_with_its_error(tcp_store, cause):
    """Whichever engine sees a failed part first, the parts waiting on it fail with the same
    error: a timed-out first part must not turn into 'peer lost' (which would also mark a
    merely frozen peer lost) because a lane's engine noticed it before the handle did."""
    first_error = (
        transport.TransferTimeout("WRITE to 'frozen': its deadline passed")
        if cause == "timeout"
        else transport.PeerLostError("'gone' went away", "gone")
    )
    with transport.Transport("writer", store=tcp_store, lanes=1) as w:
        plan = SimpleNamespace(conn=SimpleNamespace(name="ghost", lock=threading.Lock()))
        part = Part(np.zeros(1, dtype=np.int64), 1)
        handle = Handle("WRITE", ("ghost",), 1, 1)
        first = Op(handle, plan, part, b"", time.monotonic() + 30, 30.0)  # never posted
        first.error, first.state = first_error, FAILED
        waiting = Op(handle, plan, part, b"", time.monotonic() + 30, 30.0)
        waiting.after = [first]
        internals.engine(w).submit([waiting])
        assert handle.exception(10) is not None
        assert waiting.state == FAILED and waiting.error is first_error
        assert handle.errors["ghost"] is first_error
