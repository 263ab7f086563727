"""Lanes on the loopback backend: a host-to-host transfer of at least ``lane_bytes`` is cut over
``lanes`` agents of the writer, each posting from its own thread.

The receiver sees nothing new: every byte lands where one agent would have put it, the
notification comes once and after all of it, fan-out and batches work, and a frozen or restarted
receiver is handled as without lanes. Sizes are a few MiB with ``lane_bytes`` at 1 MiB, and odd
on purpose, so that shares and parts end inside rows.
"""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import agent_of, frozen, pattern
from transport.backends.loopback import LoopbackBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

LANES = {"lanes": 3, "lane_bytes": 1 << 20}
N = (5 << 20) + 7  # bytes of one large transfer


@pytest.fixture
def posters(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The loopback agent of every transfer posted, in order."""
    seen: list[str] = []
    real = LoopbackBackend.post

    def post(self: LoopbackBackend, xfer: object, notif: bytes, peer: str) -> int:
        seen.append(self.agent_name)
        return real(self, xfer, notif, peer)

    monkeypatch.setattr(LoopbackBackend, "post", post)
    return seen


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1 << 20], ids=["one-part", "1MiB-parts"])
def test_large_puts_over_lanes_land_intact_each_time(loopback_net, posters, chunk_bytes):
    dst = torch.zeros(N, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", chunk_bytes=chunk_bytes, **LANES)
    src = torch.empty(N, dtype=torch.uint8)
    for seed in range(3):  # the first cuts the plan into shares, the others replay them
        src.copy_(pattern(N, seed))
        w.put(src, r.name, "dst").wait(5)
        assert torch.equal(dst, pattern(N, seed)), seed
    # every agent of the writer posted a share: its own and both lanes'
    base = agent_of(w)
    assert {base, f"{base}.lane1", f"{base}.lane2"} <= set(posters)
    small = torch.zeros(4096, dtype=torch.uint8)
    posters.clear()
    w.put(small, r.name, "dst").wait(5)  # below lane_bytes: the writer's own agent only
    assert set(posters) == {base}
    assert torch.equal(dst[:4096], small) and torch.equal(dst[4096:], pattern(N, 2)[4096:])


def test_a_large_get_over_lanes_reads_intact(loopback_net):
    region = pattern(N, 1)
    r = loopback_net.receiver("r", {"src": region})
    w = loopback_net.make("w", **LANES)
    dst = torch.zeros(N, dtype=torch.uint8)
    for seed in (1, 2):
        region.copy_(pattern(N, seed))
        w.get(dst, r.name, "src").wait(5)
        assert torch.equal(dst, pattern(N, seed))


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1 << 20], ids=["one-part", "1MiB-parts"])
def test_a_notified_put_over_lanes_notifies_once_after_every_byte(loopback_net, chunk_bytes):
    dst = torch.zeros(N, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", chunk_bytes=chunk_bytes, **LANES)
    src = torch.empty(N, dtype=torch.uint8)
    for seed in range(3):
        src.copy_(pattern(N, seed))
        h = w.put(src, r.name, "dst", notify=b"v%d" % seed)
        note = r.wait_notification(5)
        assert (note.peer, note.payload) == (w.name, b"v%d" % seed)  # from the Transport's name
        assert torch.equal(dst, pattern(N, seed)), "notified before every share had landed"
        h.wait(5)
    # a bare notification follows every completed transfer: nothing came twice before it
    w.notify(r.name, b"end")
    assert r.wait_notification(5).payload == b"end"


def test_a_fan_out_over_lanes_to_two_peers(loopback_net):
    bufs = [torch.zeros(N, dtype=torch.uint8) for _ in range(2)]
    peers = [loopback_net.receiver(f"g{i}", {"dst": b}) for i, b in enumerate(bufs)]
    w = loopback_net.make("w", **LANES)
    src = torch.empty(N, dtype=torch.uint8)
    for seed in range(2):
        src.copy_(pattern(N, seed))
        h = w.put(src, [p.name for p in peers], "dst", notify=b"f%d" % seed)
        for p, b in zip(peers, bufs, strict=True):
            assert p.wait_notification(5).payload == b"f%d" % seed
            assert torch.equal(b, pattern(N, seed))
        h.wait(5)
        assert h.nbytes == 2 * N


def test_a_batch_over_lanes_with_notify(loopback_net):
    shapes = {"emb": (3 << 20) + 1, "w1": 1 << 20, "b1": 333}
    dst = {k: torch.zeros(n, dtype=torch.uint8) for k, n in shapes.items()}
    dst["f"] = torch.zeros(1 << 18, dtype=torch.float32)
    r = loopback_net.receiver("r", dst)
    w = loopback_net.make("w", **LANES)
    for seed in range(2):
        batch = {k: pattern(n, 10 * seed + i) for i, (k, n) in enumerate(shapes.items())}
        batch["f"] = pattern(1 << 18, 10 * seed + 9, torch.float32)
        h = w.put(batch, r.name, notify=b"b%d" % seed)
        assert r.wait_notification(5).payload == b"b%d" % seed
        for k, t in batch.items():
            assert torch.equal(dst[k], t), k
        h.wait(5)


def test_a_put_over_lanes_at_an_offset_writes_only_its_slice(loopback_net):
    region = torch.zeros((6 << 20) + 64, dtype=torch.int16)
    r = loopback_net.receiver("r", {"dst": region})
    w = loopback_net.make("w", **LANES)
    n, at = (2 << 20) + 5, (1 << 20) + 3  # elements of int16: 4 MiB and 10 bytes
    src = pattern(n, 1, torch.int16)
    w.put(src, r.name, "dst", offset=at).wait(5)
    assert torch.equal(region[at : at + n], src)
    assert region[:at].eq(0).all() and region[at + n :].eq(0).all()


def test_fan_out_over_lanes_with_an_offset_and_many_receivers(loopback_net):
    bufs = [torch.zeros(2 * N, dtype=torch.uint8) for _ in range(3)]
    peers = [loopback_net.receiver(f"g{i}", {"dst": b}) for i, b in enumerate(bufs)]
    w = loopback_net.make("w", lanes=2, lane_bytes=1 << 20)
    src = pattern(N, 4)
    w.put(src, [p.name for p in peers], "dst", offset=N).wait(5)
    for b in bufs:
        assert torch.equal(b[N:], src) and b[:N].eq(0).all()


def test_a_frozen_receiver_times_out_the_whole_transfer_over_lanes(loopback_net):
    dst = torch.zeros(N, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", chunk_bytes=1 << 20, **LANES)
    src = pattern(N, 1)
    w.put(src, r.name, "dst", notify=b"v1").wait(5)
    assert r.wait_notification(5).payload == b"v1"
    src.copy_(pattern(N, 2))
    with frozen(r):
        h = w.put(src, r.name, "dst", notify=b"v2", timeout=0.2)
        with pytest.raises(transport.TransferTimeout, match="deadline"):
            h.wait(5)
    # the first part goes alone, so a frozen receiver got nothing of the transfer
    assert torch.equal(dst, pattern(N, 1))
    src.copy_(pattern(N, 3))
    w.put(src, r.name, "dst", notify=b"v3").wait(5)
    assert torch.equal(dst, pattern(N, 3))
    assert r.wait_notification(5).payload == b"v3"  # v2's was withdrawn with its transfer


def test_a_receiver_restarted_under_its_name_gets_the_next_put_over_lanes(loopback_net):
    old = torch.zeros(N, dtype=torch.uint8)
    r0 = loopback_net.receiver("r", {"dst": old})
    w = loopback_net.make("w", heartbeat_interval=3600.0, **LANES)
    src = pattern(N, 1)
    w.put(src, r0.name, "dst", notify=b"v1").wait(5)
    assert torch.equal(old, pattern(N, 1))
    r0.close()
    new = torch.zeros(N, dtype=torch.uint8)
    r1 = loopback_net.receiver("r", {"dst": new})
    src.copy_(pattern(N, 2))
    w.put(src, r1.name, "dst", notify=b"v2").wait(5)
    assert torch.equal(new, pattern(N, 2))
    assert r1.wait_notification(5).payload == b"v2"
    src.copy_(pattern(N, 3))
    w.put(src, r1.name, "dst").wait(5)  # and the lanes reach the new incarnation too
    assert torch.equal(new, pattern(N, 3))
    assert torch.equal(old, pattern(N, 1))


def test_a_closed_receiver_fails_a_fan_out_over_lanes_only_for_itself(loopback_net):
    bufs = [torch.zeros(N, dtype=torch.uint8) for _ in range(2)]
    peers = [loopback_net.receiver(f"g{i}", {"dst": b}) for i, b in enumerate(bufs)]
    w = loopback_net.make("w", **LANES)
    src = pattern(N, 1)
    names = [p.name for p in peers]
    w.put(src, names, "dst").wait(5)
    peers[0].close()
    src.copy_(pattern(N, 2))
    h = w.put(src, names, "dst")
    err = h.exception(5)
    assert isinstance(err, transport.PeerLostError), repr(err)
    assert set(h.errors) == {names[0]}
    assert torch.equal(bufs[0], pattern(N, 1))
    assert torch.equal(bufs[1], pattern(N, 2))
