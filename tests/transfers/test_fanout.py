"""Fan-out puts (one handle, a list of peers) on the loopback backend.

Both paths are covered: the fast one (a small tensor already planned for every peer, posted from
the caller's thread) and the general one (a batch, or a tensor cut into parts). Every peer's bytes
are checked; a duplicate peer is refused before anything moves; a peer that is gone or frozen fails
the handle, naming that peer, while the others receive their bytes.
"""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

N = 3


def _peers(net, regions):
    """N receivers, each exposing its own zeroed copy of ``regions`` (name -> (numel, dtype))."""
    bufs = [{k: torch.zeros(n, dtype=dt) for k, (n, dt) in regions.items()} for _ in range(N)]
    return [net.receiver(f"g{i}", b) for i, b in enumerate(bufs)], bufs


def test_a_small_fan_out_repeated_reaches_every_peer_each_time(loopback_net):
    peers, bufs = _peers(loopback_net, {"x": (1024, torch.float32)})
    names = [p.name for p in peers]
    w = loopback_net.make("w")
    src = torch.empty(1024)
    for seed in range(6):  # the first plans, the others replay (the fast path)
        src.copy_(pattern(1024, seed, torch.float32))
        w.put(src, names, "x").wait(5)
        for i, b in enumerate(bufs):
            assert torch.equal(b["x"], pattern(1024, seed, torch.float32)), (seed, i)


def test_a_small_fan_out_with_notify_notifies_each_peer_after_its_data(loopback_net):
    peers, bufs = _peers(loopback_net, {"x": (256, torch.int64)})
    w = loopback_net.make("w")
    src = torch.empty(256, dtype=torch.int64)
    for seed in range(4):
        src.copy_(pattern(256, seed, torch.int64))
        h = w.put(src, tuple(p.name for p in peers), "x", notify=b"v%d" % seed)
        for p, b in zip(peers, bufs, strict=True):
            note = p.wait_notification(5)
            assert (note.peer, note.payload) == (w.name, b"v%d" % seed)
            assert torch.equal(b["x"], pattern(256, seed, torch.int64))
        h.wait(5)


def test_a_fan_out_of_a_batch_with_notify(loopback_net):
    peers, bufs = _peers(loopback_net, {"a": (1 << 16, torch.uint8), "b": (300, torch.int32)})
    w = loopback_net.make("w")
    for seed in range(3):
        batch = {"a": pattern(1 << 16, seed), "b": pattern(300, 50 + seed, torch.int32)}
        h = w.put(batch, [p.name for p in peers], notify=b"batch%d" % seed)
        for p, b in zip(peers, bufs, strict=True):
            assert p.wait_notification(5).payload == b"batch%d" % seed
            assert torch.equal(b["a"], batch["a"])
            assert torch.equal(b["b"], batch["b"])
        h.wait(5)
        assert h.nbytes == N * ((1 << 16) + 300 * 4)


def test_a_chunked_fan_out_notifies_each_peer_after_every_part(loopback_net):
    n = 1 << 18  # 64 parts of 4 KiB per peer
    peers, bufs = _peers(loopback_net, {"x": (n, torch.uint8)})
    w = loopback_net.make("w", chunk_bytes=4096)
    for seed in range(3):
        src = pattern(n, seed)
        h = w.put(src, [p.name for p in peers], "x", notify=b"c%d" % seed)
        for p, b in zip(peers, bufs, strict=True):
            assert p.wait_notification(5).payload == b"c%d" % seed
            assert torch.equal(b["x"], src)  # every part had landed when it was notified
        h.wait(5)


def test_a_fan_out_at_an_offset(loopback_net):
    peers, bufs = _peers(loopback_net, {"x": (4096, torch.int16)})
    w = loopback_net.make("w")
    src = pattern(100, 1, torch.int16)
    for _ in range(2):
        w.put(src, [p.name for p in peers], "x", offset=1000).wait(5)
    for b in bufs:
        assert torch.equal(b["x"][1000:1100], src)
        assert b["x"][:1000].eq(0).all() and b["x"][1100:].eq(0).all()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "planned"])
def test_a_peer_twice_in_the_list_is_refused_and_nothing_moves(loopback_net, warm):
    peers, bufs = _peers(loopback_net, {"x": (512, torch.uint8)})
    names = [p.name for p in peers]
    w = loopback_net.make("w")
    src = pattern(512, 1)
    if warm:
        w.put(src, names, "x").wait(5)  # every plan cached: the fast path sees the list first
    before = src.clone() if warm else torch.zeros(512, dtype=torch.uint8)
    src.copy_(pattern(512, 2))
    with pytest.raises(ValueError, match="a peer appears twice in the list"):
        w.put(src, [names[0], names[1], names[0]], "x")
    for b in bufs:
        assert torch.equal(b["x"], before)
    with pytest.raises(ValueError, match="the list of peers is empty"):
        w.put(src, [], "x")
    w.put(src, names, "x").wait(5)
    assert all(torch.equal(b["x"], pattern(512, 2)) for b in bufs)


class _FanOut:
    """Puts of one kind to a list of peers from sources that stay the same tensors (so the
    second put replays the plans of the first), with new contents each time."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.src = {"x": torch.empty(1024, dtype=torch.uint8)}
        if kind != "small":
            self.src["big"] = torch.empty(1 << 16, dtype=torch.uint8)
        if kind == "chunked":
            del self.src["x"]

    def put(self, w, names, seed):
        """Put new contents; returns the handle and what each peer should then hold."""
        for i, t in enumerate(self.src.values()):
            t.copy_(pattern(t.numel(), seed + i))
        want = {k: t.clone() for k, t in self.src.items()}
        if self.kind == "batch":
            return w.put(self.src, names, notify=b"n%d" % seed), want
        ((key, t),) = self.src.items()
        return w.put(t, names, key, notify=None if self.kind == "small" else b"n%d" % seed), want


@pytest.mark.parametrize("gone", [0, 1, 2])
@pytest.mark.parametrize("kind", ["small", "chunked", "batch"])
def test_a_closed_peer_fails_the_handle_naming_it_and_the_others_receive(loopback_net, kind, gone):
    peers, bufs = _peers(loopback_net, {"x": (1024, torch.uint8), "big": (1 << 16, torch.uint8)})
    names = [p.name for p in peers]
    w = loopback_net.make("w", chunk_bytes=4096)
    fan = _FanOut(kind)
    h, before = fan.put(w, names, 1)
    h.wait(5)  # connected to all, plans cached
    if kind != "small":
        for p in peers:
            p.wait_notification(5)
    peers[gone].close()
    h, want = fan.put(w, names, 10)  # the writer learns that the peer is gone only now
    err = h.exception(5)
    assert isinstance(err, transport.PeerLostError), repr(err)
    assert names[gone] in str(err)
    assert set(h.errors) == {names[gone]}
    for i, b in enumerate(bufs):
        for k, t in (before if i == gone else want).items():
            assert torch.equal(b[k], t), (i, k)
    for i, p in enumerate(peers):
        if i != gone and kind != "small":
            assert p.wait_notification(5).payload == b"n10"
    # the peers still there take the next fan-out, and the writer names the one that is gone
    rest = [n for i, n in enumerate(names) if i != gone]
    h, want = fan.put(w, rest, 20)
    h.wait(5)
    for i, b in enumerate(bufs):
        if i != gone:
            for k, t in want.items():
                assert torch.equal(b[k], t), (i, k)
    with pytest.raises(transport.PeerNotFoundError, match=f"no peer named '{names[gone]}'"):
        fan.put(w, names, 30)
    for i, b in enumerate(bufs):
        if i != gone:
            for k, t in want.items():
                assert torch.equal(b[k], t), (i, k)  # refused before anything moved


def test_a_new_tensor_to_a_list_with_a_gone_peer_is_refused_before_anything_moves(loopback_net):
    # Planning a new source reaches the gone peer's agent, so the call itself raises (what is
    # known before posting is raised by the call) and no peer receives anything.
    peers, bufs = _peers(loopback_net, {"x": (1024, torch.uint8)})
    names = [p.name for p in peers]
    w = loopback_net.make("w")
    w.put(pattern(1024, 1), names, "x").wait(5)
    peers[1].close()
    with pytest.raises(transport.PeerLostError, match=names[1]):
        w.put(pattern(1024, 2), names, "x")
    for b in bufs:
        assert torch.equal(b["x"], pattern(1024, 1))


@pytest.mark.parametrize("kind", ["small", "chunked"])
def test_a_frozen_peer_times_out_its_part_only(loopback_net, kind):
    peers, bufs = _peers(loopback_net, {"x": (1024, torch.uint8), "big": (1 << 16, torch.uint8)})
    names = [p.name for p in peers]
    w = loopback_net.make("w", chunk_bytes=4096)
    key, n = ("x", 1024) if kind == "small" else ("big", 1 << 16)
    w.put(pattern(n, 1), names, key).wait(5)
    with frozen(peers[1]):
        h = w.put(pattern(n, 2), names, key, timeout=0.2)
        err = h.exception(5)
    assert torch.equal(bufs[0][key], pattern(n, 2))
    assert torch.equal(bufs[1][key], pattern(n, 1))  # the withdrawn transfer wrote nothing
    assert torch.equal(bufs[2][key], pattern(n, 2)), "a healthy peer after the frozen one"
    assert isinstance(err, transport.TransferTimeout), repr(err)
    assert set(h.errors) == {names[1]}
    assert f"failed for 1 of 3 peers ({names[1]})" in str(err)
    w.put(pattern(n, 3), names, key).wait(5)  # thawed: every peer again
    assert all(torch.equal(b[key], pattern(n, 3)) for b in bufs)
