"""Peers that die, freeze or restart while we transfer to them."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import transport
from helpers import internals
from helpers.peer import Peer, pattern, sha
from helpers.polling import wait_until

MiB = 1 << 20


def test_kill_9_during_transfer_fails_fast_and_others_are_served(tcp_store, writer):
    a = Peer("victim", tcp_store.url, {"buf": ("uint8", 128 * MiB, "w")})
    b = Peer("survivor", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")})
    try:
        writer.wait_for_peer("victim", 30)
        writer.wait_for_peer("survivor", 30)
        src = pattern(128 * MiB, 1)
        writer.put(src, "victim", "buf").wait(30)  # connected and working
        # keep large puts flowing to the victim, and kill it while one is in flight
        started = threading.Event()
        handles: list[transport.Handle] = []

        def pump() -> None:
            for _ in range(200):
                h = writer.put(src, "victim", "buf", timeout=30)
                handles.append(h)
                started.set()
                if h.exception(timeout=30) is not None:
                    return

        th = threading.Thread(target=pump)
        th.start()
        assert started.wait(30)
        a.kill()
        th.join(60)
        assert not th.is_alive()
        err = handles[-1].exception(timeout=1.0)  # the failing put has completed by now
        assert isinstance(err, transport.PeerLostError), repr(err)
        assert "victim" in str(err)
        # a put issued after the death fails within a second too (raised by the call: the dead
        # peer's record is still in the store, but it cannot be reached)
        with pytest.raises(transport.PeerLostError, match="victim"):
            writer.put(src[: 4 * MiB], "victim", "buf").wait(1.0)
        # the writer still serves the other receiver, every byte
        src2 = pattern(4 * MiB, 2)
        writer.put(src2, "survivor", "buf").wait(10)
        assert b.call("sha", "buf") == sha(src2)
    finally:
        a.kill()
        b.stop()


def test_sigstop_gives_transfer_timeout_then_recovers(tcp_store, writer):
    with Peer("frozen", tcp_store.url, {"x": ("uint8", 1 * MiB, "rw")}) as r:
        writer.wait_for_peer("frozen", 30)
        src = pattern(1 * MiB, 5)
        writer.put(src, "frozen", "x", notify=b"warm").wait(10)
        assert r.call("notifications", 10) == [("writer", b"warm")]
        r.signal(signal.SIGSTOP)
        try:
            # a notified put needs the receiver to take part; frozen, it never completes
            h = writer.put(src, "frozen", "x", notify=b"lost", timeout=1.0)
            err = h.exception(timeout=10)  # completes at its 1 s deadline, not later
            assert isinstance(err, transport.TransferTimeout), repr(err)
            assert isinstance(err, TimeoutError)
            assert "frozen" in str(err)
        finally:
            r.signal(signal.SIGCONT)
        src2 = pattern(1 * MiB, 6)
        writer.put(src2, "frozen", "x", notify=b"back", timeout=10).wait(10)
        got = []
        while ("writer", b"back") not in got:
            batch = r.call("notifications", 5)
            assert batch, "no notification after SIGCONT"
            got += batch
        assert ("writer", b"lost") not in got or got.index(("writer", b"lost")) < got.index(
            ("writer", b"back")
        )
        assert r.call("sha", "x") == sha(src2)


def test_a_frozen_peer_is_suspect_in_peers_until_it_beats_again(tcp_store, writer):
    """Heartbeats are read: a stopped peer (its record stays) is listed as suspect, with the age
    of its last heartbeat, once that is older than the bar of transport/peers/liveness.py; running
    again, it beats and is not. Nothing is timed: the test waits, bounded, for each state."""

    def suspect() -> str | None:
        return {i.name: i for i in writer.peers()}["frozen"].suspect

    with Peer("frozen", tcp_store.url, {"x": ("uint8", MiB, "rw")}) as r:
        writer.wait_for_peer("frozen", 30)
        assert suspect() is None
        r.signal(signal.SIGSTOP)
        try:
            wait_until(suspect, 60, "peers() reporting the stopped peer suspect")
            why = suspect()
            assert why is not None and "heartbeat" in why and "s old" in why, why
            assert writer.wait_for_peer("frozen", timeout=0).suspect  # the same judgement
            assert {i.name: i for i in writer.peers()}["writer"].suspect is None
        finally:
            r.signal(signal.SIGCONT)
        wait_until(lambda: suspect() is None, 30, "the peer beating again")
        src = pattern(MiB, 9)
        writer.put(src, "frozen", "x", timeout=10).wait(10)
        assert r.call("sha", "x") == sha(src)


def test_wait_timeout_does_not_cancel_the_transfer(tcp_store, writer):
    """A wait that runs out cancels nothing: the transfer lands once the peer runs again. (A
    one-sided write may also complete while the peer is stopped, the writer copying: then the
    wait does not run out. That the wait never cancels is shown deterministically, with a
    frozen agent, in tests/core/test_failures.py.)"""
    with Peer("slow", tcp_store.url, {"x": ("uint8", MiB, "rw")}) as r:
        writer.wait_for_peer("slow", 30)
        writer.put(torch.zeros(MiB, dtype=torch.uint8), "slow", "x", notify=b"a").wait(10)
        r.signal(signal.SIGSTOP)
        try:
            src = pattern(MiB, 8)
            h = writer.put(src, "slow", "x", notify=b"b", timeout=30)
            try:
                h.wait(timeout=0.2)
            except transport.TransferTimeout as e:
                assert "does not cancel" in str(e)
        finally:
            r.signal(signal.SIGCONT)
        h.wait(timeout=30)  # the same transfer completes once the peer runs again
        assert r.call("sha", "x") == sha(src)


@pytest.fixture
def unwatched_writer(tcp_store):
    """A writer whose control thread never looks at the store on its own (no heartbeats, no
    generation watch), so that only the put itself can notice that a peer restarted."""
    with transport.Transport("writer", store=tcp_store, timeout=30, heartbeat_interval=3600) as t:
        yield t


def test_restarted_receiver_gets_the_next_put(tcp_store, unwatched_writer, caplog):
    writer = unwatched_writer
    first = Peer("gen-0", tcp_store.url, {"w": ("float32", 4096, "rw")})
    try:
        writer.wait_for_peer("gen-0", 30)
        writer.put(torch.ones(4096), "gen-0", "w").wait(10)
        assert first.call("sha", "w") == sha(torch.ones(4096))
        first.kill()
    finally:
        first.kill()
    with Peer("gen-0", tcp_store.url, {"w": ("float32", 4096, "rw")}) as second:
        assert second.generation == first.generation + 1
        src = torch.full((4096,), 2.0)
        with caplog.at_level("INFO", logger="transport"):
            writer.put(src, "gen-0", "w").wait(10)  # the very next put lands in the new process
        assert second.call("sha", "w") == sha(src)
        assert f"restarted (generation {second.generation}); retrying" in caplog.text
        big = torch.randn(1 << 20)
        with Peer("gen-1", tcp_store.url, {"w": ("float32", 1 << 20, "rw")}) as other:
            writer.wait_for_peer("gen-1", 30)
            writer.put(big, "gen-1", "w").wait(10)
            assert other.call("sha", "w") == sha(big)


def test_closed_peer_is_gone_from_the_store(tcp_store, writer):
    with Peer("leaver", tcp_store.url, {"x": ("uint8", 64, "rw")}):
        writer.wait_for_peer("leaver", 30)
        assert "leaver" in {p.name for p in writer.peers()}
    assert "leaver" not in {p.name for p in writer.peers()}
    with pytest.raises(transport.PeerNotFoundError, match="leaver"):
        writer.put(torch.zeros(64, dtype=torch.uint8), "leaver", "x").wait(5)


def test_an_old_incarnation_that_closes_late_leaves_the_new_ones_record_and_heartbeat(
    tcp_store, writer
):
    """A process restarted under the same name while its old incarnation still runs (a late
    close): the old one's close removes neither the new one's record nor its heartbeat, and a
    put reaches the new one. The new one beats every 30 s: the heartbeat seen after the close is
    the one it wrote at its start."""
    old = transport.Transport("restarted", store=tcp_store)
    new = transport.Transport("restarted", store=tcp_store, heartbeat_interval=30)
    try:
        dst = torch.zeros(64, dtype=torch.uint8)
        new.expose("x", dst, access="w")
        writer.wait_for_peer("restarted", 30, regions=["x"])
        old.close()
        (info,) = [p for p in writer.peers() if p.name == "restarted"]
        assert info.generation == new.generation > old.generation
        assert info.last_heartbeat is not None and not info.suspect
        src = pattern(64, 3)
        writer.put(src, "restarted", "x").wait(10)
        assert torch.equal(dst, src)
    finally:
        old.close()
        new.close()


def test_restarted_receiver_gets_the_next_large_put(tcp_store, unwatched_writer, caplog):
    """A put posted in parts by the engine is re-planned for the new incarnation too."""
    writer = unwatched_writer
    n = 96 * MiB  # two parts at the default part size
    first = Peer("gen-0", tcp_store.url, {"w": ("uint8", n, "rw")})
    try:
        writer.wait_for_peer("gen-0", 30)
        writer.put(pattern(n, 1), "gen-0", "w").wait(30)
    finally:
        first.kill()
    with Peer("gen-0", tcp_store.url, {"w": ("uint8", n, "rw")}) as second:
        src = pattern(n, 2)
        with caplog.at_level("INFO", logger="transport"):
            writer.put(src, "gen-0", "w", notify=b"v2").wait(30)
        assert f"restarted (generation {second.generation}); retrying" in caplog.text
        peer, payload, shas = second.call("notif_then_sha", 30, ["w"])
        assert (peer, payload) == ("writer", b"v2") and shas["w"] == sha(src)


def test_small_fan_out_with_a_restarted_and_a_dead_peer(
    tcp_store, unwatched_writer, caplog, monkeypatch
):
    """A small put to a list of peers whose cached plans are replayed from the caller's thread:
    a peer that restarted since gets the put in its new process (the rest of the list goes
    through the general path, same handle); a peer that is gone fails the handle, naming it,
    while the others still get their bytes."""
    writer = unwatched_writer
    spec = {"w": ("uint8", 4096, "rw")}
    a = Peer("gen-a", tcp_store.url, spec)
    b = Peer("gen-b", tcp_store.url, spec)
    c = Peer("gen-c", tcp_store.url, spec)
    try:
        for p in ("gen-a", "gen-b", "gen-c"):
            writer.wait_for_peer(p, 30)
        src = pattern(4096, 1)
        writer.put(src, ["gen-a", "gen-b", "gen-c"], "w").wait(10)
        writer.put(src, ["gen-a", "gen-b", "gen-c"], "w").wait(10)  # now cached, caller's thread
        b.kill()
        with Peer("gen-b", tcp_store.url, spec) as b2:
            assert b2.generation == b.generation + 1
            src2 = pattern(4096, 2)
            src.copy_(src2)  # the same source tensor: its plans are cached
            rests: list[tuple[str, ...]] = []
            rest_of_fanout = internals.transfers(writer).rest_of_fanout

            def spy(handle, t, rest, *args):
                rests.append(rest)
                return rest_of_fanout(handle, t, rest, *args)

            monkeypatch.setattr(internals.transfers(writer), "rest_of_fanout", spy)
            with caplog.at_level("INFO", logger="transport"):
                writer.put(src, ["gen-a", "gen-b", "gen-c"], "w", notify=b"v2").wait(10)
            assert f"restarted (generation {b2.generation}); retrying" in caplog.text
            assert rests == [("gen-b", "gen-c")]  # gen-a from the caller's thread, the rest not
            for p in (a, b2, c):
                peer, payload, shas = p.call("notif_then_sha", 10, ["w"])
                assert (peer, payload) == ("writer", b"v2") and shas["w"] == sha(src2), p.name
        # gen-b closed for good (its record is gone); gen-c killed without a word
        c.kill()
        src3 = pattern(4096, 3)
        src.copy_(src3)
        h = writer.put(src, ["gen-a", "gen-c"], "w")
        with pytest.raises(transport.TransportError, match="gen-c"):
            h.wait(10)
        assert "gen-c" in h.errors and "gen-a" not in h.errors
        assert a.call("sha", "w") == sha(src3)
    finally:
        for p in (a, b, c):
            p.kill()
