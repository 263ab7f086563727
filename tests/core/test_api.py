"""The facade's contract: handles, awaiting, callbacks, the module-level API, idle cost."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import transport
from helpers.peer import Peer, sha

MiB = 1 << 20


@pytest.fixture
def pair(tcp_store):
    """Two Transports in this process (each with its own NIXL agent), the second exposing regions."""
    with (
        transport.Transport("a", store=tcp_store) as a,
        transport.Transport("b", store=tcp_store) as b,
    ):
        small, big = torch.zeros(1024), torch.zeros(8 * MiB, dtype=torch.uint8)
        b.expose_all({"small": small, "big": big})
        a.wait_for_peer("b", 10, regions=["small", "big"])
        yield a, b, small, big


def test_await_a_handle(pair):
    a, b, small, big = pair

    async def main() -> None:
        src = torch.randint(0, 255, (8 * MiB,), dtype=torch.uint8)
        await a.put(src, "b", "big")
        assert torch.equal(big, src)
        await a.put(torch.ones(1024), "b", "small")
        assert torch.equal(small, torch.ones(1024))
        with pytest.raises(transport.RegionError):
            await a.put(torch.ones(2048), "b", "small")

    asyncio.run(main())


def test_wait_all_and_done_callbacks(pair):
    a, b, small, big = pair
    seen: list[transport.Handle] = []
    fired = threading.Event()
    handles = [a.put(torch.full((8 * MiB,), i, dtype=torch.uint8), "b", "big") for i in range(3)]
    handles[-1].add_done_callback(lambda h: (seen.append(h), fired.set()))
    transport.wait_all(handles, timeout=30)
    assert fired.wait(10) and seen == [handles[-1]]
    assert all(h.done() and h.exception() is None for h in handles)
    assert torch.equal(big, torch.full((8 * MiB,), 2, dtype=torch.uint8))
    # a callback added after completion runs at once
    late: list[int] = []
    handles[0].add_done_callback(lambda h: late.append(1))
    assert late == [1]


def test_waiting_inside_a_callback_is_refused(pair):
    a, b, small, big = pair
    outcome: list[BaseException] = []
    fired = threading.Event()

    def cb(h: transport.Handle) -> None:
        other = a.put(torch.zeros(8 * MiB, dtype=torch.uint8), "b", "big")
        try:
            other.wait(1)
        except RuntimeError as e:
            outcome.append(e)
        fired.set()

    h = a.put(torch.ones(8 * MiB, dtype=torch.uint8), "b", "big")
    h.add_done_callback(cb)
    h.wait(10)
    assert fired.wait(10)
    if threading.current_thread().name.startswith("transport-engine"):
        pytest.fail("the test must not run on the engine thread")
    # when the callback ran on the engine thread, the wait was refused rather than deadlocking
    assert not outcome or "engine thread" in str(outcome[0])


def test_notifications_generator_and_wait(pair):
    a, b, small, big = pair
    assert list(b.notifications(timeout=0)) == []
    for i in range(3):
        a.put(torch.full((1024,), float(i)), "b", "small", notify=f"v{i}".encode()).wait(5)
    got = [n.payload for n in b.notifications(timeout=2)][:3]
    assert got == [b"v0", b"v1", b"v2"]
    with pytest.raises(transport.TransferTimeout, match="no notification"):
        b.wait_notification(timeout=0.05)


def test_get_of_a_batch(pair):
    a, b, small, big = pair
    small.copy_(torch.arange(1024, dtype=torch.float32))
    big.fill_(7)
    dst = {"small": torch.zeros(1024), "big": torch.zeros(8 * MiB, dtype=torch.uint8)}
    a.get(dst, "b").wait(10)
    assert torch.equal(dst["small"], small) and torch.equal(dst["big"], big)


def test_wait_for_peer_times_out_with_a_timeout_error(tcp_store):
    with transport.Transport("lonely", store=tcp_store) as t:
        with pytest.raises(transport.PeerWaitTimeout, match="'nobody' did not appear") as info:
            t.wait_for_peer("nobody", timeout=0.2)
        assert isinstance(info.value, TimeoutError)


def test_module_level_api(tcp_store):
    with Peer("gen-0", tcp_store.url, {"w": ("float32", 256, "rw")}) as g:
        t = transport.init("trainer-0", store=tcp_store)
        try:
            with pytest.raises(RuntimeError, match="already called"):
                transport.init("again", store=tcp_store)
            t.wait_for_peer("gen-0", 30)
            src = torch.randn(256)
            transport.put(src, "gen-0", "w").wait(10)
            assert g.call("sha", "w") == sha(src)
            back = torch.zeros(256)
            transport.get(back, "gen-0", "w").wait(10)
            assert torch.equal(back, src)
        finally:
            transport.shutdown()
        assert not transport.is_initialized()
        with pytest.raises(transport.ClosedError, match="transport.init"):
            transport.put(src, "gen-0", "w")


def test_close_fails_transfers_in_flight_and_unblocks_waiters(tcp_store):
    import signal

    # (a tiny notified put can complete into the socket buffer of a stopped peer; 1 MiB cannot)
    with Peer("frozen", tcp_store.url, {"x": ("uint8", MiB, "rw")}) as r:
        t = transport.Transport("w", store=tcp_store)
        t.wait_for_peer("frozen", 30)
        t.put(torch.zeros(MiB, dtype=torch.uint8), "frozen", "x", notify=b"a").wait(10)
        r.signal(signal.SIGSTOP)
        try:
            h = t.put(torch.ones(MiB, dtype=torch.uint8), "frozen", "x", notify=b"b", timeout=60)
            t.close()
            assert isinstance(h.exception(timeout=5), transport.ClosedError)
        finally:
            r.signal(signal.SIGCONT)


def test_notify_without_data_follows_earlier_puts(pair):
    """The deadlines bound a hang, not the speed: b has no connection to a, so a's first
    notification waits for b's housekeeping to find a's agent in the store, a thread that a
    loaded 2-core machine may starve for seconds (5 s were once missed in the full suite)."""
    a, b, small, big = pair
    a.put(torch.full((1024,), 5.0), "b", "small").wait(30)
    a.notify("b", b"hello")
    n = b.wait_notification(timeout=30)
    assert (n.peer, n.payload) == ("a", b"hello")
    assert torch.equal(small, torch.full((1024,), 5.0))
    with pytest.raises(transport.PeerNotFoundError):
        a.notify("ghost", b"x")
    with pytest.raises(TypeError):
        a.notify("b", "text")  # type: ignore[arg-type]


def test_control_messages_reach_their_handler_not_the_user(pair):
    a, b, small, big = pair
    got: list[tuple[str, bytes]] = []
    seen = threading.Event()
    b.core.on_control("test", lambda peer, payload: (got.append((peer, payload)), seen.set()))
    a.core.send_control("b", "test", b"\x01\x02")
    a.core.send_control("b", "nobody-listens", b"x")
    assert seen.wait(5) and got == [("a", b"\x01\x02")]
    assert list(b.notifications(timeout=0.2)) == []
