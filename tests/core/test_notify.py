"""Notifications on the loopback backend: the queue a receiver reads, and the promise that a
notification comes after the data it vouches for.

``notify()`` keeps each sender's order; ``wait_notification(peer=...)`` takes the next one from
that peer and leaves the others queued; a wait that runs out raises TransferTimeout (a
TimeoutError) and takes nothing; ``notifications(timeout=0)`` yields only what is already here.
A put cut into parts notifies after its last part, so the receiver that sees version N's
notification reads version N.
"""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers import internals
from helpers.loopback_net import agent_of, frozen, pattern
from helpers.polling import wait_until
from transport.wire import MAX_NOTIFY_BYTES, frame_user_notification

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_each_senders_notifications_keep_their_order_and_follow_its_puts(loopback_net):
    k, size = 20, 64
    slots = {
        "a": torch.zeros(k * size, dtype=torch.uint8),
        "b": torch.zeros(k * size, dtype=torch.uint8),
    }
    r = loopback_net.receiver("r", slots)
    senders = {s: loopback_net.make(s) for s in ("a", "b")}
    for i in range(k):  # interleaved: a0 b0 a1 b1 ...
        for s, t in senders.items():
            t.put(pattern(size, 100 * i + ord(s)), r.name, s, offset=i * size).wait(5)
            t.notify(r.name, b"%s%d" % (s.encode(), i))
    got: dict[str, list[bytes]] = {t.name: [] for t in senders.values()}
    for _ in range(2 * k):
        note = r.wait_notification(5)
        got[note.peer].append(note.payload)
        s, i = chr(note.payload[0]), int(note.payload[1:])
        # the put completed before the notify() call has landed when its notification is read
        want = pattern(size, 100 * i + ord(s))
        assert torch.equal(slots[s][i * size : (i + 1) * size], want), note
    for s, t in senders.items():
        assert got[t.name] == [b"%s%d" % (s.encode(), i) for i in range(k)]
    assert list(r.notifications(timeout=0)) == []


def test_notifications_sent_to_a_frozen_receiver_arrive_in_order_once_it_runs(loopback_net):
    dst = torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    w.put(pattern(4096, 1), r.name, "dst").wait(5)
    with frozen(r):
        for i in range(5):
            w.notify(r.name, b"held%d" % i)
    assert [r.wait_notification(5).payload for _ in range(5)] == [b"held%d" % i for i in range(5)]
    assert torch.equal(dst, pattern(4096, 1))


def test_waiting_for_one_peer_leaves_the_others_queued(loopback_net):
    dst = torch.zeros(1024, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    a, b = loopback_net.make("a"), loopback_net.make("b")
    b.put(pattern(512, 1), r.name, "dst", notify=b"b1").wait(5)
    b.notify(r.name, b"b2")
    a.put(pattern(512, 2), r.name, "dst", offset=512, notify=b"a1").wait(5)
    # a1 was sent after b's two, so when a1 is here they are queued too, and stay queued
    note = r.wait_notification(5, peer=a.name)
    assert (note.peer, note.payload) == (a.name, b"a1")
    assert torch.equal(dst[512:], pattern(512, 2))
    rest = list(r.notifications(timeout=0))
    assert [(n.peer, n.payload) for n in rest] == [(b.name, b"b1"), (b.name, b"b2")]
    assert torch.equal(dst[:512], pattern(512, 1))


def test_a_wait_for_a_notification_that_runs_out_raises_transfer_timeout(loopback_net):
    dst = torch.zeros(256, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    a, b = loopback_net.make("a"), loopback_net.make("b")
    with pytest.raises(transport.TransferTimeout, match=r"no notification arrived within 0\.05 s"):
        r.wait_notification(0.05)
    a.put(pattern(256, 1), r.name, "dst", notify=b"from a").wait(5)
    # a's notification is queued, but the wait is for b's: it runs out and takes nothing
    with pytest.raises(TimeoutError, match=f"no notification from '{b.name}' arrived within"):
        r.wait_notification(0.05, peer=b.name)
    note = r.wait_notification(5)
    assert (note.peer, note.payload) == (a.name, b"from a")
    assert torch.equal(dst, pattern(256, 1))
    assert list(r.notifications(timeout=0)) == []
    with pytest.raises(transport.TransferTimeout):
        r.wait_notification(0.01, peer=a.name)


def test_notifications_with_a_timeout_yield_what_comes_then_stop(loopback_net):
    dst = torch.zeros(8 * 128, dtype=torch.int32)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    assert list(r.notifications(timeout=0)) == []
    for i in range(8):
        w.put(pattern(128, i, torch.int32), r.name, "dst", offset=128 * i, notify=b"%d" % i).wait(5)
    seen = []
    for note in r.notifications(timeout=5):
        i = int(note.payload)
        assert torch.equal(dst[128 * i : 128 * (i + 1)], pattern(128, i, torch.int32))
        seen.append(i)
        if len(seen) == 8:
            break
    assert seen == list(range(8))
    assert list(r.notifications(timeout=0.01)) == []


@pytest.mark.parametrize("inline_bytes", [1 << 20, 0], ids=["caller-posted", "engine-posted"])
def test_a_chunked_put_notifies_after_its_last_part(loopback_net, inline_bytes):
    n = (1 << 18) + 3  # 65 parts of at most 4 KiB
    dst = torch.zeros(n, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", chunk_bytes=4096, inline_bytes=inline_bytes)
    src = torch.empty(n, dtype=torch.uint8)
    for seed in range(4):
        src.copy_(pattern(n, seed))
        h = w.put(src, r.name, "dst", notify=b"v%d" % seed)  # not waited: the notification is
        note = r.wait_notification(5)  # what tells the receiver that the data is there
        assert note.payload == b"v%d" % seed
        assert torch.equal(dst, pattern(n, seed)), "notified before every part had landed"
        h.wait(5)


def test_a_chunked_batch_held_by_a_frozen_receiver_notifies_after_all_of_it(loopback_net):
    regions = {
        "a": torch.zeros(40000, dtype=torch.uint8),
        "b": torch.zeros(9000, dtype=torch.int64),
    }
    r = loopback_net.receiver("r", regions)
    w = loopback_net.make("w", chunk_bytes=8192)
    batch = {"a": pattern(40000, 1), "b": pattern(9000, 2, torch.int64)}
    with frozen(r):
        h = w.put(batch, r.name, notify=b"batch")
        assert not h.done()  # its first parts are held by the frozen receiver
    note = r.wait_notification(5)
    assert note.payload == b"batch"
    assert torch.equal(regions["a"], batch["a"]) and torch.equal(regions["b"], batch["b"])
    h.wait(5)


def test_notification_payloads_arrive_byte_for_byte(loopback_net):
    dst = torch.zeros(128, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    largest = bytes(pattern(64 << 10, 7).tolist())  # the limit, 64 KiB, of arbitrary bytes
    payloads = [b"", b"\x00\xff\x00", largest, bytearray(b"ba"), memoryview(b"mv")]
    for i, p in enumerate(payloads):
        w.put(pattern(128, i), r.name, "dst", notify=p).wait(5)
        note = r.wait_notification(5)
        assert note.payload == bytes(p) and type(note.payload) is bytes
        assert torch.equal(dst, pattern(128, i))
    w.notify(r.name, largest)
    assert r.wait_notification(5).payload == largest


def test_bad_notifications_are_refused_before_anything_moves(loopback_net):
    dst = torch.zeros(128, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    src = pattern(128, 1)
    w.put(src, r.name, "dst").wait(5)  # planned: the next puts take the fast path
    src.copy_(pattern(128, 2))
    with pytest.raises(TypeError, match="notify must be bytes, got str"):
        w.put(src, r.name, "dst", notify="v2")
    with pytest.raises(ValueError, match=r"notify payload is 65537 bytes; the limit is 65536"):
        w.put(src, r.name, "dst", notify=bytes(65537))
    with pytest.raises(ValueError, match="the limit is 65536"):
        w.put({"dst": src}, r.name, notify=bytes(65537))
    with pytest.raises(TypeError, match="notify must be bytes"):
        w.notify(r.name, "text")
    with pytest.raises(transport.PeerNotFoundError, match="no peer named"):
        w.notify(loopback_net.name("nobody"), b"x")
    assert torch.equal(dst, pattern(128, 1))
    assert list(r.notifications(timeout=0)) == []


def test_a_flood_of_notifications_is_bounded_and_the_queue_keeps_the_oldest(loopback_net, caplog):
    """A peer that sends faster than the receiver reads cannot grow its memory without bound:
    past the bound the newest are dropped (and logged), what was queued stays, in order, and
    once read there is room again."""
    r = loopback_net.make("r")
    internals.control_channel(r).max_queued = 8
    w = loopback_net.make("w")
    with frozen(r):  # held: they reach r's queue together, in one batch, after the thaw
        for i in range(20):
            w.notify(r.name, b"n%d" % i)
    # the first 8 can be read before the rest is routed (held while the receiver checks the
    # sender in the store): wait until all 20 were routed, 12 of them dropped
    wait_until(lambda: r.dropped_notifications == 12, 10, "the 12 newest to be dropped")
    got = [r.wait_notification(5).payload for _ in range(8)]
    assert got == [b"n%d" % i for i in range(8)]
    assert list(r.notifications(timeout=0)) == []  # the 12 newest were dropped
    assert "dropped 12 notifications" in caplog.text and r.dropped_notifications == 12
    w.notify(r.name, b"after")  # read, there is room again
    assert r.wait_notification(5).payload == b"after"


def test_a_frame_over_the_size_limit_is_dropped_on_receipt(loopback_net, caplog):
    """The 64 KiB limit holds for whoever sends: a sender that is not this library (here our
    own agent, used raw) cannot queue a larger payload at the receiver."""
    r = loopback_net.make("r")
    w = loopback_net.make("w")
    w.notify(r.name, b"hello")  # connected
    assert r.wait_notification(5).payload == b"hello"
    huge = frame_user_notification(b"")[:1] + bytes(MAX_NOTIFY_BYTES + 1)  # one byte too many
    internals.backend(w).send_notif(agent_of(r), huge, r.name)
    w.notify(r.name, b"after")  # sent after the huge one: once it is here, that one was seen
    assert r.wait_notification(5).payload == b"after"
    assert list(r.notifications(timeout=0)) == []
    assert "the most a peer may send" in caplog.text


def test_the_queue_is_bounded_in_bytes_too(loopback_net):
    r = loopback_net.make("r")
    internals.control_channel(r).max_queued_bytes = 4 * MAX_NOTIFY_BYTES
    w = loopback_net.make("w")
    payloads = [bytes([i]) * MAX_NOTIFY_BYTES for i in range(10)]
    with frozen(r):
        for p in payloads:
            w.notify(r.name, p)
    assert r.wait_notification(5).payload == payloads[0]
    assert [n.payload for n in r.notifications(timeout=0)] == payloads[1:4]
    assert r.dropped_notifications == 6


def test_an_unchecked_senders_frames_are_handled_on_the_engine_thread_in_order(loopback_net):
    """Without a secret, the frames of a sender the receiver has never connected to wait while
    housekeeping checks it in the store; then they, and every later one, go to the control
    handler on the engine thread (as ``on_control`` promises), each sender's in the order sent,
    whichever side of the check they arrived on."""
    r = loopback_net.make("r")
    w = loopback_net.make("w")
    got: list[tuple[str, bytes]] = []
    threads: set[str] = set()

    def handler(peer: str, payload: bytes) -> None:
        threads.add(threading.current_thread().name)
        got.append((peer, payload))

    r.core.on_control("test/order", handler)
    n = 400
    for i in range(n):
        w.core.send_control(r.name, "test/order", b"%d" % i)
    wait_until(lambda: len(got) == n, 10, f"{n} control messages")
    assert got == [(w.name, b"%d" % i) for i in range(n)]
    assert threads == {internals.engine(r).thread.name}


def test_a_first_burst_of_32_mib_from_an_unchecked_sender_arrives_whole(loopback_net):
    """The receiver has never connected to the sender, so its frames wait while it is checked in
    the store: a first burst as large as the queue of unread notifications takes is held whole,
    not cut at a smaller bound of its own."""
    r = loopback_net.make("r")
    w = loopback_net.make("w")
    n, size = 512, MAX_NOTIFY_BYTES  # 32 MiB
    with frozen(r):  # the whole burst reaches r before it routes any of it
        for i in range(n):
            w.notify(r.name, bytes([i % 251]) * size)
    got = [r.wait_notification(10).payload for _ in range(n)]
    assert [p[0] for p in got] == [i % 251 for i in range(n)]
    assert all(len(p) == size for p in got)
    assert r.refused_notifications == 0 and r.dropped_notifications == 0
