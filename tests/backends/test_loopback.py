"""The in-process loopback backend: two Transports in this process move real bytes through the
engine, plans, fan-out and notifications in milliseconds, and its faults (a frozen agent, a
closed one) drive the failure paths. Never a stand-in for the NIXL integration tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import transport
from transport.backends import loopback
from transport.backends.loopback import LoopbackBackend
from transport.store import MemoryStore

pytestmark = pytest.mark.unit

_names = itertools.count()


@pytest.fixture
def pair() -> Iterator[tuple[transport.Transport, transport.Transport]]:
    """A writer and a receiver on one in-memory store, both on the loopback backend."""
    n = next(_names)
    store = MemoryStore()
    w = transport.Transport(f"w{n}", store=store, backend="loopback", timeout=10)
    r = transport.Transport(f"r{n}", store=store, backend="loopback", timeout=10)
    yield w, r
    w.close()
    r.close()
    store.close()


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_put_get_and_a_notified_batch_move_the_bytes(pair):
    w, r = pair
    a, b = torch.zeros(1 << 20, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    r.expose_all({"a": a, "b": b})
    w.wait_for_peer(r.name, 5)
    src = pattern(1 << 20, 1)
    w.put(src, r.name, "a").wait(5)
    assert torch.equal(a, src)
    w.put({"a": pattern(1 << 20, 2), "b": pattern(4096, 3)}, r.name, notify=b"v2").wait(5)
    note = r.wait_notification(5)
    assert (note.peer, note.payload) == (w.name, b"v2")
    assert torch.equal(a, pattern(1 << 20, 2)) and torch.equal(b, pattern(4096, 3))
    back = torch.zeros(4096, dtype=torch.uint8)
    w.get(back, r.name, "b").wait(5)
    assert torch.equal(back, b)
    w.put(torch.full((16,), 7, dtype=torch.uint8), r.name, "b", offset=100).wait(5)
    assert b[100:116].eq(7).all() and b[99] == pattern(4096, 3)[99]


def test_fan_out_writes_every_peer():
    store = MemoryStore()
    n = next(_names)
    with transport.Transport(f"w{n}", store=store, backend="loopback", timeout=10) as w:
        peers = [
            transport.Transport(f"g{n}-{i}", store=store, backend="loopback") for i in range(3)
        ]
        try:
            bufs = [torch.zeros(8192) for _ in peers]
            for p, buf in zip(peers, bufs, strict=True):
                p.expose("w", buf)
                w.wait_for_peer(p.name, 5)
            w.put(torch.arange(8192.0), [p.name for p in peers], "w").wait(5)
            assert all(torch.equal(buf, torch.arange(8192.0)) for buf in bufs)
        finally:
            for p in peers:
                p.close()


def test_a_frozen_peer_times_the_put_out_and_a_thawed_one_takes_the_next(pair):
    w, r = pair
    buf = torch.zeros(4096, dtype=torch.uint8)
    r.expose("buf", buf)
    w.wait_for_peer(r.name, 5)
    w.put(pattern(4096, 1), r.name, "buf").wait(5)  # connected
    agent = f"{r.name}#{r.generation}"  # the receiver's agent (name#generation)
    loopback.freeze(agent)
    try:
        with pytest.raises(transport.TransferTimeout):
            w.put(pattern(4096, 2), r.name, "buf", timeout=0.2).wait(5)
        assert torch.equal(buf, pattern(4096, 1))  # nothing of the timed-out put landed
    finally:
        loopback.thaw(agent)
    w.put(pattern(4096, 3), r.name, "buf").wait(5)
    assert torch.equal(buf, pattern(4096, 3))


def test_a_closed_peer_fails_the_put_with_peer_lost(pair):
    w, r = pair
    r.expose("buf", torch.zeros(4096, dtype=torch.uint8))
    w.wait_for_peer(r.name, 5)
    w.put(pattern(4096, 1), r.name, "buf").wait(5)
    r.close()
    with pytest.raises((transport.PeerLostError, transport.PeerNotFoundError)):
        w.put(pattern(4096, 2), r.name, "buf").wait(5)


def test_the_backend_refuses_memory_it_did_not_register():
    a, b = LoopbackBackend("lb-a"), LoopbackBackend("lb-b")
    try:
        src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
        a.register(src.data_ptr(), 64, "cpu")
        token = b.register(dst.data_ptr(), 64, "cpu")
        peer = a.add_peer(b.metadata())
        rows = lambda t, n: np.array([[t.data_ptr(), n, 0]], dtype=np.uint64)  # noqa: E731
        with pytest.raises(transport.RegionError):
            a.prep(None, rows(src, 65), "cpu")
        x = a.make_xfer(
            "WRITE",
            a.prep(None, rows(src, 64), "cpu"),
            np.array([0]),
            a.prep(peer, rows(dst, 64), "cpu"),
            np.array([0]),
            b"n",
            "b",
        )
        b.deregister(token)
        with pytest.raises(transport.PeerLostError):
            a.post(x, b"n", "b")
        assert dst.eq(0).all()
        b.register(dst.data_ptr(), 64, "cpu")
        assert a.post(x, b"n", "b") == 0 and dst.eq(1).all()
        assert b.get_notifs() == {"lb-a": [b"n"]}
        with pytest.raises(transport.BackendError, match="host memory only"):
            a.register(0, 1, "cuda:0")
    finally:
        a.close()
        b.close()
