"""An idle Transport sleeps: its engine wakes when there is work (a transfer of ours, a peer's
ring, a deadline), not on a timer. The counts here are upper bounds that load cannot break: a
loaded host makes a sleeping thread come back later, never sooner, and only voluntary context
switches are counted (load adds involuntary ones). What must still happen while the engine
sleeps is shown by engines whose longest sleep is an hour: only a ring or a deadline wakes them
within the tests' waits."""

from __future__ import annotations

import signal
import socket

import pytest

import transport
from helpers import internals
from helpers.peer import Peer, pattern, sha

MiB = 1 << 20
#: seconds counted while idle
IDLE_S = 4.0
#: the most turns an idle engine may make in IDLE_S at its default longest sleep of 1 s: one a
#: second, and a few for the wake-ups its own calls cause
MAX_IDLE_TURNS = 8
#: the most voluntary context switches any one thread of an idle Transport may make in IDLE_S,
#: engine included (the heartbeat's and housekeeping's rounds are a few store calls each second)
MAX_THREAD_SWITCHES = 25 * IDLE_S
#: the share of a core the whole idle process may use (load only lowers it)
IDLE_SHARE = 0.02
#: an engine that only a ring or a deadline wakes within the tests' waits
ASLEEP = 3600.0


def test_an_idle_transport_sleeps(tcp_store):
    """Counted inside the process: after start-up, an idle Transport's engine turns about once a
    second (its longest sleep), and no thread of the process, NIXL's and UCX's included, wakes
    more than a few times a second."""
    with Peer("idle", tcp_store.url, {"x": ("float32", 1024, "rw")}) as p:
        p.call("sha", "x")
        p.call("idle_counts", 0.5)  # the back-off after start-up ends
        got = p.call("idle_counts", IDLE_S)
    assert got["engine"] <= MAX_IDLE_TURNS, f"the idle engine turned {got['engine']} times"
    busy = {n: c for n, c in got["threads"].items() if c > MAX_THREAD_SWITCHES}
    assert not busy, f"threads of an idle Transport woke too often in {IDLE_S:g} s: {busy}"
    assert got["cpu"] < IDLE_SHARE * IDLE_S, f"an idle Transport used {got['cpu']:.3f} s of CPU"


@pytest.fixture(params=["default", "tcp-poll", "tcp-events"])
def ucx_paths(request, monkeypatch):
    """UCX as this host picks it (shared memory, the engine makes progress), and kept to TCP
    with the engine making progress or NIXL's progress thread sleeping on UCX's events."""
    if request.param != "default":
        monkeypatch.setenv("UCX_TLS", "tcp")
        monkeypatch.setenv("TRANSPORT_PROGRESS", request.param.split("-")[1])
    return request.param


def test_a_sleeping_engine_still_completes_puts_notifications_and_deadlines(tcp_store, ucx_paths):
    """Both engines sleep up to an hour. A put with a notification lands byte for byte and its
    notification is read (the writer's ring wakes the receiver, which over TCP must make
    progress for the put to complete at all); a notification alone is read; a put to a frozen
    peer fails at its deadline of 1 s."""
    with Peer("r", tcp_store.url, {"x": ("uint8", MiB, "rw")}, idle_interval=ASLEEP) as r:
        with transport.Transport("w", store=tcp_store, idle_interval=ASLEEP) as w:
            w.wait_for_peer("r", 60)
            r.call("idle_counts", 0.5)  # the receiver has gone to sleep
            src = pattern(MiB, 7)
            w.put(src, "r", "x", notify=b"landed").wait(60)
            assert r.call("notification", 60, timeout=90) == ("w", b"landed")
            assert r.call("sha", "x") == sha(src)
            r.call("idle_counts", 0.5)
            w.notify("r", b"alone")
            assert r.call("notification", 60, timeout=90) == ("w", b"alone")
            r.signal(signal.SIGSTOP)
            try:
                h = w.put(pattern(MiB, 8), "r", "x", notify=b"never", timeout=1.0)
                assert isinstance(h.exception(timeout=60), transport.TransferTimeout)
            finally:
                r.signal(signal.SIGCONT)


def test_only_notifications_ring_a_receiver_whose_bytes_land_without_it(tcp_store, monkeypatch):
    """Over TCP with NIXL's progress thread (``events``), a put's bytes land without the
    receiver's engine: a writer rings it only for a notification (counted on the writer)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("TRANSPORT_PROGRESS", "events")
    with Peer("r", tcp_store.url, {"x": ("uint8", 4096, "rw")}) as r:
        with transport.Transport("w", store=tcp_store) as w:
            w.wait_for_peer("r", 60)
            sent = internals.engine(w).doorbell.sent
            for seed in range(3):
                src = pattern(4096, seed)
                w.put(src, "r", "x").wait(60)
                assert r.call("sha", "x") == sha(src)
            assert internals.engine(w).doorbell.sent == sent
            w.put(pattern(4096, 9), "r", "x", notify=b"n").wait(60)
            assert r.call("notification", 60, timeout=90) == ("w", b"n")
            assert internals.engine(w).doorbell.sent == sent + 1


def test_a_ring_without_the_token_wakes_nothing(tcp_store):
    """With a secret, the token a ring must carry is not in the stored record (it is sealed), and
    datagrams without it are refused: they make the engine read, never make progress. The right
    token, sent after them on the same socket, shows when all were read."""
    secret = b"doorbell-secret"
    with Peer("r", tcp_store.url, {"x": ("uint8", 4096, "rw")}, secret=secret) as r:
        ip, port, token, rings, refused = r.call("doorbell")
        raw = tcp_store.get("transport/default/peers/r")
        assert token not in raw
        guesses = (b"", b"x" * 16, token[:15], token + b"!", bytes(16))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for guess in guesses:
                s.sendto(guess, (ip, port))
            s.sendto(token, (ip, port))
            assert r.call("wait_rings", rings + 1, 60.0, timeout=90) == rings + 1
        assert r.call("doorbell")[3:] == (rings + 1, refused + len(guesses))


@pytest.mark.parametrize(
    "bad",
    [
        b"x",  # too short
        bytes(22),  # neither an IPv4 nor an IPv6 bell
        bytes(17) + b"\0\0" + bytes(4),  # port 0
        bytes(16) + b"\2" + b"\0\1" + bytes(4),  # flags other than 0 or 1
    ],
)
def test_a_record_carries_the_doorbell_and_a_bad_one_is_refused(bad, monkeypatch):
    """The bell a record carries decodes to what was published; one of the wrong size, port 0
    or unknown flags is a WireFormatError naming the field."""
    from transport.doorbell import Bell
    from transport.errors import WireFormatError
    from transport.wire import decode_peer_record, encode_peer_record

    with transport.Transport("b", store="memory://bell", backend="loopback") as t:
        stored = t.store.get("transport/default/peers/b")
        rec = decode_peer_record(stored)
        assert rec.bell is not None and rec.bell == internals.engine(t).doorbell.bell
        assert decode_peer_record(encode_peer_record(rec)).bell == rec.bell
        monkeypatch.setattr(Bell, "pack", lambda self: bad)
        with pytest.raises(WireFormatError, match="bell"):
            decode_peer_record(encode_peer_record(rec))
