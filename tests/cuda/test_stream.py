"""Stream-ordered transfers without a GPU: the clear error of ``stream=``, and the proxy thread,
slots, handles and error paths driven by the host's stand-in for the two kernels
(helpers.host_stream), with real peers and real NIXL transfers. The kernels themselves are
compiled to PTX here; tests/cuda/test_stream_gpu.py runs them on a GPU."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import transport
from helpers.host_stream import install
from helpers.peer import Peer, pattern, sha
from helpers.processes import REPO
from transport.cuda.proxy import BELL, DONE, FAILED

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_stream_without_cuda_is_a_clear_error_and_sends_nothing(tcp_store, writer):
    with Peer("target", tcp_store.url, {"buf": ("uint8", 4 * KiB, "w")}) as p:
        writer.wait_for_peer("target", 30)
        before = p.call("sha", "buf")
        for call in (
            lambda: writer.put(pattern(4 * KiB, 1), "target", "buf", stream=object()),
            lambda: writer.get(
                torch.zeros(4 * KiB, dtype=torch.uint8), "target", "buf", stream=object()
            ),
        ):
            with pytest.raises(RuntimeError, match=r"no CUDA device.*without stream="):
                call()
        pub = transport.WeightPublisher(writer, {"w": torch.zeros(8)}, group="g")
        with pytest.raises(RuntimeError, match="no CUDA device"):
            pub.publish(stream=object())
        with pytest.raises(ValueError, match="pass version=None"):
            pub.publish(3, stream=object())
        pub.close()
        assert p.call("sha", "buf") == before
        writer.check()  # nothing pending


def test_every_ring_sends_the_data_of_that_moment(tcp_store, writer):
    ops = install(writer)
    with Peer("target", tcp_store.url, {"buf": ("uint8", 1 * MiB, "w")}) as p:
        writer.wait_for_peer("target", 30)
        src = torch.zeros(1 * MiB, dtype=torch.uint8)
        writer.register(src, "src")
        for i in range(1, 51):
            src.copy_(pattern(MiB, i))  # "the kernel before the put"
            h = writer.put(src, "target", "buf", stream="s0")
            h.wait(30)
            assert h.done() and not h.failed()
            assert p.call("sha", "buf") == sha(pattern(MiB, i)), f"ring {i}"
        assert len(ops.proxy.slots) == 1  # the same put on the same stream: one slot
        slot = ops.proxy.slots[0]
        assert ops.proxy.word(slot, BELL) == ops.proxy.word(slot, DONE) == 50
        writer.check()


def test_wait_stream_holds_the_stream_until_the_data_landed(tcp_store, writer):
    ops = install(writer)
    with Peer("target", tcp_store.url, {"buf": ("uint8", 64 * MiB, "w")}) as p:
        writer.wait_for_peer("target", 30)
        src = pattern(64 * MiB, 5)
        h = writer.put(src, "target", "buf", stream="s0")
        h.wait_stream(timeout=30)  # the host stand-in returns once the stream may go on
        slot = ops.proxy.slots[0]
        assert ops.proxy.word(slot, DONE) >= 1
        assert p.call("sha", "buf") == sha(src)


def test_a_captured_put_replays_with_new_data_and_allocates_nothing(tcp_store, writer):
    ops = install(writer)
    with Peer("target", tcp_store.url, {"buf": ("float32", 1024, "w")}) as p:
        writer.wait_for_peer("target", 30)
        src = torch.zeros(1024)
        ops.capture = True
        with pytest.raises(transport.TransportError, match="register them before capturing"):
            writer.put(src, "target", "buf", stream="graph")  # a capture cannot register memory
        assert ops.proxy.slots == []  # refused before anything was enqueued
        ops.capture = False
        writer.register(src, "src")
        ops.capture = True
        h = writer.put(src, "target", "buf", stream="graph")
        ops.capture = False
        with pytest.raises(RuntimeError, match="no host-side wait"):
            h.wait(1)
        slot = ops.proxy.slots[0]
        words = ops.words.data_ptr()
        for i in range(2, 10_001):  # 10,000 replays (the capture rang once)
            src.fill_(float(i))
            seq = ops.replay(slot)
            ops.proxy.wait_done(slot, seq, 30)
            if i % 2500 == 0:
                expected = sha(torch.full((1024,), float(i)))
                assert p.call("sha", "buf") == expected, f"replay {i}"
        assert len(ops.proxy.slots) == 1 and ops.words.data_ptr() == words
        assert ops.proxy.word(slot, DONE) == 10_000 and ops.proxy.word(slot, FAILED) == 0
        writer.check()


def test_a_failed_transfer_releases_the_stream_and_raises_at_the_next_check(tcp_store, writer):
    ops = install(writer)
    p = Peer("victim", tcp_store.url, {"buf": ("uint8", 4 * KiB, "w")})
    try:
        writer.wait_for_peer("victim", 30)
        src = pattern(4 * KiB, 3)
        writer.put(src, "victim", "buf", stream="s0").wait(30)
        p.kill()
        h = writer.put(src, "victim", "buf", stream="s0", timeout=5)
        slot = ops.proxy.slots[0]
        h.wait_stream(timeout=30)  # released, not hung
        assert ops.proxy.word(slot, DONE) == 2 and ops.proxy.word(slot, FAILED) == 2
        assert h.failed()
        with pytest.raises(transport.PeerLostError):
            writer.put(src, "victim", "buf")  # the next put raises the stream's error
        writer.check()  # raised once
        with pytest.raises(transport.PeerLostError):
            h.wait(5)  # the handle still tells its own outcome
    finally:
        p.kill()


@contextlib.contextmanager
def frozen_peer(tcp_store, writer) -> Iterator[tuple[torch.Tensor, Peer]]:
    """A peer written once with a notified stream put (slot 1 done), then SIGSTOPped until the
    block ends; yields the source and the peer (notified puts into a stopped peer cannot
    complete)."""
    with Peer("frozen", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")}) as p:
        writer.wait_for_peer("frozen", 30)
        src = pattern(4 * MiB, 9)
        writer.put(src, "frozen", "buf", notify=b"x", stream="s0").wait(30)
        p.signal(signal.SIGSTOP)
        try:
            yield src, p
        finally:
            p.signal(signal.SIGCONT)


def test_a_frozen_peer_fails_at_the_deadline_and_the_stream_goes_on(tcp_store, writer):
    ops = install(writer)
    with frozen_peer(tcp_store, writer) as (src, _):
        h = writer.put(src, "frozen", "buf", notify=b"x", stream="s0", timeout=0.5)
        h.wait_stream(timeout=30)
        assert h.failed()
        with pytest.raises(transport.TransferTimeout):
            writer.check()
    slot = ops.proxy.slots[0]
    with Peer("frozen", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")}):
        writer.wait_for_peer("frozen", 30)  # a new incarnation under the same name
        h = writer.put(src, "frozen", "buf", notify=b"x", stream="s0", timeout=30)
        h.wait(30)
    assert ops.proxy.word(slot, DONE) == 3 and ops.proxy.word(slot, FAILED) == 2


def test_a_stream_that_gives_up_waiting_raises_at_the_next_check(tcp_store, writer):
    ops = install(writer)
    with frozen_peer(tcp_store, writer) as (src, p):
        h = writer.put(src, "frozen", "buf", notify=b"x", stream="s0", timeout=30)
        h.wait_stream(timeout=0.2)  # the stream stops waiting long before the deadline
        with pytest.raises(transport.TransferTimeout, match="stopped waiting"):
            writer.check()
        assert not h.done()
        p.signal(signal.SIGCONT)
        h.wait(30)  # the transfer itself completes once the peer runs
    assert ops.proxy.word(ops.proxy.slots[0], FAILED) == 0


def test_bad_stream_input_is_checked_before_anything_is_enqueued(tcp_store, writer):
    ops = install(writer)
    with Peer("target", tcp_store.url, {"buf": ("uint8", 4 * KiB, "w")}) as p:
        writer.wait_for_peer("target", 30)
        before = p.call("sha", "buf")
        with pytest.raises(transport.RegionError):
            writer.put(torch.zeros(8 * KiB, dtype=torch.uint8), "target", "buf", stream="s0")
        with pytest.raises(transport.PeerNotFoundError):
            writer.put(torch.zeros(4 * KiB, dtype=torch.uint8), "nobody", "buf", stream="s0")
        with pytest.raises(ValueError, match="timeout"):
            writer.put(
                torch.zeros(4 * KiB, dtype=torch.uint8), "target", "buf", stream="s0", timeout=-1
            )
        assert ops.proxy.slots == []
        assert p.call("sha", "buf") == before


def test_a_stream_ordered_publish_sends_the_next_version_each_time(tcp_store, writer):
    from helpers.ws_peer import SubscriberProcess

    ops = install(writer)
    spec = {"w": ((4096,), "float32")}
    sub = SubscriberProcess("gen-0", tcp_store.url, spec)
    try:
        tensors = {"w": torch.zeros(4096)}
        pub = transport.WeightPublisher(writer, tensors)
        for v in range(1, 6):
            tensors["w"].fill_(v)
            h = pub.publish(stream="s0", timeout=20)
            h.wait(30)
            assert pub.version == v
            assert sub.call("wait_for_version", v, 10) == v
            assert sub.call("apply") == v
            assert sub.call("live") == {"w": (float(v), float(v))}
        assert len(ops.proxy.slots) == 1
        pub.close()
    finally:
        sub.stop()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", sorted((REPO / "csrc").glob("*.cu")), ids=lambda p: p.name)
def test_every_cuda_source_compiles_to_ptx(source: Path, tmp_path):
    out = subprocess.run(
        ["nvcc", "--ptx", "-arch=sm_90", str(source), "-o", str(tmp_path / "out.ptx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    ptx = (tmp_path / "out.ptx").read_text()
    for kernel in ("transport_ring", "transport_wait"):
        if kernel in source.read_text():
            assert f".entry {kernel}" in ptx
