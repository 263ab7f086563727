"""Stream-ordered puts on a real GPU: order on the stream, graph capture and replay, failures that
release the stream, no growth over 10,000 replays, VRAM and pinned memory as sources and
destinations. Two processes on one GPU; the receiver hashes what landed."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.peer import Peer, pattern, sha
from transport.cuda.stream import unavailable

WHY = unavailable()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

MiB = 1 << 20


def spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds (so a put that ignored the
    stream's order would read the source before the kernel below wrote it)."""
    cycles = int(ms * 1e6)  # about 1 cycle per ns
    internals.busy_gpu(cycles)  # sync-ok: a busy GPU kernel that orders the stream


def test_a_put_follows_the_kernel_before_it_and_later_kernels_wait(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"buf": ("float32", 4 * MiB, "w", "cuda:0")}) as p:
        writer.wait_for_peer("recv", 30)
        src = torch.zeros(4 * MiB, device="cuda")
        writer.register(src, "src")
        s = torch.cuda.Stream()
        for i in range(1, 6):
            with torch.cuda.stream(s):
                spin(20)
                src.fill_(float(i))  # the kernel the put must follow
                h = writer.put(src, "recv", "buf", stream=s)
                h.wait_stream()  # later work waits for the data to land ...
                src.fill_(-1.0)  # ... so this never reaches the receiver
            s.synchronize()
            writer.check()
            assert p.call("sha", "buf") == sha(torch.full((4 * MiB,), float(i))), f"step {i}"


def test_a_captured_put_replays_50_times_with_the_values_of_each_moment(tcp_store, writer):
    with Peer("recv", tcp_store.url, {"buf": ("float32", MiB, "w", "cuda:0")}) as p:
        writer.wait_for_peer("recv", 30)
        step = torch.zeros(1, device="cuda")
        src = torch.zeros(MiB, device="cuda")
        writer.register(src, "src")
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            src.copy_(step.expand(MiB) * 2)  # warm up outside capture
        s.synchronize()
        with torch.cuda.graph(g, stream=s):
            src.copy_(step.expand(MiB) * 2)
            h = writer.put(src, "recv", "buf", stream=s)
            h.wait_stream(s)
        for i in range(1, 51):
            step.fill_(float(i))
            g.replay()
            torch.cuda.synchronize()
            writer.check()
            assert p.call("sha", "buf") == sha(torch.full((MiB,), 2.0 * i)), f"replay {i}"


def test_a_failure_releases_the_stream_and_the_process_lives(tcp_store, writer):
    p = Peer("victim", tcp_store.url, {"buf": ("float32", MiB, "w", "cuda:0")})
    try:
        writer.wait_for_peer("victim", 30)
        src = torch.ones(MiB, device="cuda")
        s = torch.cuda.Stream()
        writer.put(src, "victim", "buf", stream=s).wait_stream(s)
        s.synchronize()
        p.kill()
        with torch.cuda.stream(s):
            h = writer.put(src, "victim", "buf", stream=s, timeout=5)
            h.wait_stream(s, timeout=20)
            after = torch.zeros(1, device="cuda")
            after.fill_(7.0)  # work after the failed put still runs
        s.synchronize()  # returns: the stream was released
        assert float(after) == 7.0
        assert h.failed()
        with pytest.raises(transport.PeerLostError):
            writer.check()
    finally:
        p.kill()


def test_10000_replays_allocate_nothing(tcp_store, writer):
    """10,000 replays back to back send the last value and allocate nothing."""
    with Peer("recv", tcp_store.url, {"buf": ("float32", 1024, "w", "cuda:0")}) as p:
        writer.wait_for_peer("recv", 30)
        step = torch.zeros(1, device="cuda")
        src = torch.zeros(1024, device="cuda")
        s = torch.cuda.Stream()
        writer.register(src, "src")  # a capture cannot register memory: see the last test
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            src.copy_(step.expand(1024))
            writer.put(src, "recv", "buf", stream=s).wait_stream(s)
        ops = writer.core.stream_ops()
        slots, words = len(ops.proxy.slots), ops.words.data_ptr()
        torch.cuda.synchronize()
        mem = torch.cuda.memory_allocated()
        for i in range(1, 10_001):
            if i % 1000 == 0:
                step.fill_(float(i))
            g.replay()
        torch.cuda.synchronize()
        writer.check()
        assert len(ops.proxy.slots) == slots and ops.words.data_ptr() == words
        assert torch.cuda.memory_allocated() == mem
        assert p.call("sha", "buf") == sha(torch.full((1024,), 10_000.0))


@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_vram_and_pinned_memory_as_sources_and_destinations(tcp_store, writer, where):
    dev = "cuda:0" if where == "cuda" else "cpu"
    with Peer("recv", tcp_store.url, {"buf": ("uint8", 64 * MiB, "rw", dev)}) as p:
        writer.wait_for_peer("recv", 30)
        data = pattern(64 * MiB, 11)
        src = data.cuda() if where == "cuda" else data.pin_memory()
        writer.put(src, "recv", "buf").wait(30)
        assert p.call("sha", "buf") == sha(data)
        back = torch.zeros_like(src)
        writer.get(back, "recv", "buf").wait(30)
        assert sha(back) == sha(data)
        if where == "cuda":
            # GPU transfers stay on one agent (64 MiB = lane_bytes)
            assert not internals.lanes(writer)


def test_a_captured_publish_sends_the_next_version_every_replay(tcp_store, writer):
    from helpers.ws_peer import SubscriberProcess

    spec = {f"w{i}": ((4096,), "float32") for i in range(8)}
    sub = SubscriberProcess("gen-0", tcp_store.url, spec)
    try:
        step = torch.zeros(1, device="cuda")
        tensors = {n: torch.zeros(4096, device="cuda") for n in spec}
        pub = transport.WeightPublisher(writer, tensors)
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for t in tensors.values():
                t.copy_(step.expand(4096))
            pub.publish(stream=s, timeout=20).wait_stream(s)
        for v in range(1, 11):
            step.fill_(float(v))
            g.replay()
            torch.cuda.synchronize()
            writer.check()
            assert pub.version == v
            assert sub.call("wait_for_version", v, 10) == v
            assert sub.call("apply") == v
            assert sub.call("live") == {n: (float(v), float(v)) for n in spec}
        pub.close()
    finally:
        sub.stop()


def test_a_tensor_not_registered_is_refused_inside_a_capture_and_the_capture_ends(
    tcp_store, writer
):
    """Registering memory inside a capture breaks the capture (or stalls the replays' transfers):
    such a put is refused with the way out, the capture ends cleanly, and the same put captured
    after registering replays."""
    with Peer("recv", tcp_store.url, {"buf": ("float32", 1024, "w", "cuda:0")}) as p:
        writer.wait_for_peer("recv", 30)
        src = torch.full((1024,), 3.0, device="cuda")
        s = torch.cuda.Stream()
        with pytest.raises(transport.TransportError, match="register them before capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s):
                writer.put(src, "recv", "buf", stream=s)
        writer.register(src, "src")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            writer.put(src, "recv", "buf", stream=s).wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        writer.check()
        assert p.call("sha", "buf") == sha(src.cpu())
