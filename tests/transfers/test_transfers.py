"""Puts and gets between real processes, every byte checked."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.peer import Peer, pattern, sha

MiB = 1 << 20


@pytest.fixture(scope="module")
def big_receiver_store():
    from transport.store.tcp import TcpStore

    s = TcpStore("127.0.0.1", 0, hosting="yes")
    yield s
    s.close()


@pytest.fixture(scope="module")
def big_receiver(big_receiver_store):
    with Peer("recv", big_receiver_store.url, {"buf": ("uint8", 256 * MiB, "rw")}) as p:
        yield p


@pytest.fixture(scope="module")
def big_writer(big_receiver_store, big_receiver):
    with transport.Transport("writer", store=big_receiver_store, timeout=60) as t:
        t.wait_for_peer("recv", timeout=30, regions=["buf"])
        yield t


@pytest.mark.parametrize("nbytes", [4 << 10, 1 * MiB, 64 * MiB, 256 * MiB])
def test_put_lands_every_byte(big_writer, big_receiver, nbytes):
    big_receiver.call("zero", "buf")
    src = pattern(nbytes, seed=nbytes)
    h = big_writer.put(src, "recv", "buf")
    assert isinstance(h, transport.Handle)
    h.wait(timeout=60)
    assert h.done() and h.exception() is None
    assert big_receiver.call("sha_range", "buf", 0, nbytes) == sha(src)
    if nbytes < 256 * MiB:  # nothing beyond the tensor was touched
        rest = 256 * MiB - nbytes
        assert big_receiver.call("sha_range", "buf", nbytes, rest) == sha(
            torch.zeros(rest, dtype=torch.uint8)
        )


@pytest.mark.parametrize("nbytes", [4 << 10, 64 * MiB, 256 * MiB])
def test_get_reads_every_byte(big_writer, big_receiver, nbytes):
    expect = big_receiver.call("fill", "buf", 7)
    dst = torch.empty(256 * MiB, dtype=torch.uint8)
    big_writer.get(dst[:nbytes], "recv", "buf").wait(timeout=60)
    full = pattern(256 * MiB, 7)
    assert torch.equal(dst[:nbytes], full[:nbytes])
    assert sha(full) == expect


def test_put_full_region_hash(big_writer, big_receiver):
    src = pattern(256 * MiB, seed=99)
    big_writer.put(src, "recv", "buf").wait(timeout=60)
    assert big_receiver.call("sha", "buf") == sha(src)


def test_offsets_write_only_the_slice(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"v": ("float32", 1000, "rw")}) as r:
        writer.wait_for_peer("recv", 30)
        src = torch.arange(10, dtype=torch.float32) + 1
        writer.put(src, "recv", "v", offset=500).wait(10)
        raw = r.call("read", "v", 0, 4000)
        got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        expect = torch.zeros(1000)
        expect[500:510] = src
        assert torch.equal(got, expect)
        # read a slice back from an offset
        dst = torch.zeros(4)
        writer.get(dst, "recv", "v", offset=502).wait(10)
        assert torch.equal(dst, src[2:6])
        # the last element exactly fits; one more does not
        writer.put(torch.tensor([9.0]), "recv", "v", offset=999).wait(10)
        with pytest.raises(transport.RegionError, match="do not fit"):
            writer.put(torch.tensor([1.0, 2.0]), "recv", "v", offset=999)


def test_batch_of_500_is_one_transfer_with_one_notification(tcp_store, writer):
    sizes = [(i % 7 + 1) * 1024 for i in range(500)]
    regions = {f"layers.{i}.w": ("uint8", n, "w") for i, n in enumerate(sizes)}
    with Peer("recv", tcp_store.url, regions) as r:
        writer.wait_for_peer("recv", 30)
        batch = {f"layers.{i}.w": pattern(n, seed=i) for i, n in enumerate(sizes)}
        h = writer.put(batch, "recv", notify=b"v1")
        h.wait(30)
        # the plan behind the batch is a single backend transfer
        plans = [p for p in internals.plans(writer) if p.conn.name == "recv"]
        assert len(plans) == 1 and len(plans[0].parts) == 1 and plans[0].parts[0].count == 500
        peer, payload, shas = r.call("notif_then_sha", 30, list(batch))
        assert (peer, payload) == ("writer", b"v1")
        # hashes taken when the notification arrived: every tensor had landed before it
        assert shas == {k: sha(v) for k, v in batch.items()}
        assert r.call("notifications", 0) == []  # exactly one notification


def test_large_batch_in_parts_notifies_once_after_all(tcp_store):
    with transport.Transport("writer", store=tcp_store, chunk_bytes=1 * MiB) as w:
        regions = {f"t{i}": ("uint8", 300 * 1024, "rw") for i in range(20)}
        with Peer("recv", tcp_store.url, regions) as r:
            w.wait_for_peer("recv", 30)
            batch = {f"t{i}": pattern(300 * 1024, seed=100 + i) for i in range(20)}
            w.put(batch, "recv", notify=b"done").wait(30)
            plan = next(p for p in internals.plans(w) if p.conn.name == "recv")
            assert len(plan.parts) > 1
            peer, payload, shas = r.call("notif_then_sha", 30, list(batch))
            assert payload == b"done"
            assert shas == {k: sha(v) for k, v in batch.items()}
            assert r.call("notifications", 0) == []


def test_fan_out_to_three_receivers(tcp_store, writer):
    peers = [Peer(f"gen-{i}", tcp_store.url, {"w": ("uint8", 2 * MiB, "w")}) for i in range(3)]
    try:
        for p in peers:
            writer.wait_for_peer(p.name, 30)
        src = pattern(2 * MiB, seed=3)
        h = writer.put(src, [p.name for p in peers], "w", notify=b"step-1")
        assert h.peers == ("gen-0", "gen-1", "gen-2")
        h.wait(30)
        for p in peers:
            peer, payload, shas = p.call("notif_then_sha", 30, ["w"])
            assert (peer, payload) == ("writer", b"step-1")
            assert shas["w"] == sha(src)
    finally:
        for p in peers:
            p.stop()


def test_small_fan_out_puts_land_at_every_receiver_each_time(tcp_store, writer, monkeypatch):
    """Repeated small puts to a list of peers (after the first, posted from the caller's thread
    one peer after the other): every receiver gets every version's bytes and its notification."""
    peers = [Peer(f"gen-{i}", tcp_store.url, {"w": ("uint8", 4096, "w")}) for i in range(3)]
    try:
        for p in peers:
            writer.wait_for_peer(p.name, 30)
        names = [p.name for p in peers]
        src = torch.zeros(4096, dtype=torch.uint8)
        posted_inline: list[str] = []
        post_inline = internals.engine(writer).post_inline

        def spy(handle, plan, notif, timeout):
            posted_inline.append(plan.conn.name)
            return post_inline(handle, plan, notif, timeout)

        monkeypatch.setattr(internals.engine(writer), "post_inline", spy)
        for step in range(30):
            src.copy_(pattern(4096, seed=step))
            writer.put(src, names, "w", notify=f"v{step}".encode()).wait(30)
            for p in peers:
                peer, payload, shas = p.call("notif_then_sha", 30, ["w"])
                assert (peer, payload) == ("writer", f"v{step}".encode())
                assert shas["w"] == sha(src), (p.name, step)
        # after the first put (which plans), the caller's thread posted to each peer in turn
        assert posted_inline == names * 29
        for p in peers:
            assert p.call("notifications", 0) == []  # one notification per put, no more
    finally:
        for p in peers:
            p.stop()


def test_put_without_key_uses_exposed_or_registered_name(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"a": ("int64", 16, "rw"), "b": ("int64", 16, "rw")}) as r:
        writer.wait_for_peer("recv", 30)
        a = torch.arange(16)
        writer.expose("a", a)  # exposed locally under the same name
        writer.put(a, "recv").wait(10)
        b = torch.arange(16) * 3
        writer.register(b, name="b")
        writer.put(b, "recv").wait(10)
        assert r.call("read", "a", 0, 128) == a.numpy().tobytes()
        assert r.call("read", "b", 0, 128) == b.numpy().tobytes()
        with pytest.raises(ValueError, match="pass key="):
            writer.put(torch.arange(16), "recv")


def test_repeated_puts_replay_the_plan(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"x": ("float32", 1024, "rw")}) as r:
        writer.wait_for_peer("recv", 30)
        src = torch.zeros(1024)
        for step in range(200):
            src.fill_(step)
            writer.put(src, "recv", "x").wait(10)
        assert r.call("read", "x", 0, 4096) == torch.full((1024,), 199.0).numpy().tobytes()
        assert len(internals.plans(writer)) == 1


def test_put_and_get_on_each_store(any_store):
    """The same transfers with peers found through the embedded TCPStore and through Redis."""
    with Peer("recv", any_store.url, {"x": ("bfloat16", 4096, "rw")}) as r:
        with transport.Transport("writer", store=any_store) as w:
            w.wait_for_peer("recv", 30)
            src = torch.randn(4096).to(torch.bfloat16)
            w.put(src, "recv", "x").wait(10)
            assert r.call("sha", "x") == sha(src)
            back = torch.zeros(4096, dtype=torch.bfloat16)
            w.get(back, "recv", "x").wait(10)
            assert torch.equal(back, src)
            assert {p.name for p in w.peers()} == {"recv", "writer"}


def test_notifications_name_the_sender(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"x": ("uint8", 64, "rw")}) as r:
        writer.wait_for_peer("recv", 30)
        for i in range(5):
            writer.put(
                torch.full((64,), i, dtype=torch.uint8), "recv", "x", notify=f"n{i}".encode()
            ).wait(10)
        got = []
        while len(got) < 5:
            got += r.call("notifications", 5)
        assert got == [("writer", f"n{i}".encode()) for i in range(5)]
