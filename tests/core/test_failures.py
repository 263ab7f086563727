"""Failure paths of the core on the loopback backend: a frozen peer, closing the writer, and a
peer that restarts under its name.

A frozen peer (``loopback.freeze`` of its agent, as SIGSTOP stops a process) fails a transfer at
its deadline with TransferTimeout, nothing of it lands and its notification is never sent, and the
Transport goes on once the peer runs again. ``close()`` fails what is in flight with ClosedError
and wakes every thread waiting on the Transport. A peer that closes and comes back under the
same name receives the next put, on its new incarnation. Threads synchronize on events and
handles, never on sleeps.
"""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

# Restart tests: the writer's heartbeat would also notice a restart (within heartbeat_interval);
# a long one leaves it to the put, the path these tests are about.
NO_HEARTBEAT = {"heartbeat_interval": 3600.0}

KINDS = {  # how the writer moves the bytes: (bytes, Transport options)
    "inline": (4096, {}),  # one part, posted from the caller's thread
    "engine": (4096, {"inline_bytes": 0}),  # one part, posted by the engine thread
    "chunked": (1 << 16, {"chunk_bytes": 4096}),  # 16 parts, posted by the engine thread
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_frozen_peer_fails_a_put_at_its_deadline_and_the_next_one_lands(loopback_net, kind):
    n, options = KINDS[kind]
    dst = torch.zeros(n, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", **options)
    src = pattern(n, 1)
    w.put(src, r.name, "dst", notify=b"v1").wait(5)
    assert r.wait_notification(5).payload == b"v1"
    assert torch.equal(dst, pattern(n, 1))
    src.copy_(pattern(n, 2))
    with frozen(r):
        h = w.put(src, r.name, "dst", notify=b"v2", timeout=0.2)
        with pytest.raises(transport.TransferTimeout, match=r"deadline of 0\.2 s passed"):
            h.wait(5)
        assert isinstance(h.exception(0), TimeoutError)
    assert torch.equal(dst, pattern(n, 1)), "the withdrawn transfer wrote into the region"
    src.copy_(pattern(n, 3))
    w.put(src, r.name, "dst", notify=b"v3").wait(5)
    assert torch.equal(dst, pattern(n, 3))
    # v2's notification was withdrawn with its transfer: the next one the receiver sees is v3
    assert r.wait_notification(5).payload == b"v3"
    assert list(r.notifications(timeout=0)) == []


def test_a_get_from_a_frozen_peer_fails_at_its_deadline_and_the_next_one_reads(loopback_net):
    region = pattern(8192, 1)
    r = loopback_net.receiver("r", {"src": region})
    w = loopback_net.make("w")
    dst = torch.zeros(8192, dtype=torch.uint8)
    w.get(dst, r.name, "src").wait(5)
    assert torch.equal(dst, pattern(8192, 1))
    region.copy_(pattern(8192, 2))
    with frozen(r):
        with pytest.raises(transport.TransferTimeout, match="deadline"):
            w.get(dst, r.name, "src", timeout=0.2).wait(5)
    assert torch.equal(dst, pattern(8192, 1))
    w.get(dst, r.name, "src").wait(5)
    assert torch.equal(dst, pattern(8192, 2))


def test_a_wait_that_runs_out_cancels_nothing(loopback_net):
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", chunk_bytes=4096)
    src = pattern(1 << 16, 1)
    with frozen(r):
        h = w.put(src, r.name, "dst", notify=b"late")
        with pytest.raises(transport.TransferTimeout, match="the wait does not cancel it"):
            h.wait(0.05)
        assert not h.done()
    h.wait(5)  # the transfer went on once the peer ran again
    assert torch.equal(dst, src)
    assert r.wait_notification(5).payload == b"late"


def test_small_puts_to_a_healthy_peer_go_on_while_another_is_frozen(loopback_net):
    x_buf, r_buf = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    x = loopback_net.receiver("x", {"b": x_buf})
    r = loopback_net.receiver("r", {"b": r_buf})
    w = loopback_net.make("w")
    src = torch.empty(256, dtype=torch.uint8)
    with frozen(x):
        src.copy_(pattern(256, 1))
        held = w.put(src.clone(), x.name, "b")
        for seed in range(2, 6):
            src.copy_(pattern(256, seed))
            w.put(src, r.name, "b").wait(5)
            assert torch.equal(r_buf, pattern(256, seed))
        assert not held.done()
    held.wait(5)
    assert torch.equal(x_buf, pattern(256, 1))


def test_a_chunked_put_to_a_frozen_peer_does_not_hold_back_one_to_a_healthy_peer(loopback_net):
    x_buf, r_buf = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(1 << 16, dtype=torch.uint8)
    x = loopback_net.receiver("x", {"b": x_buf})
    r = loopback_net.receiver("r", {"b": r_buf})
    w = loopback_net.make("w", chunk_bytes=4096)
    w.put(pattern(1 << 16, 1), [x.name, r.name], "b").wait(5)  # connected to both
    with frozen(x):
        hx = w.put(pattern(1 << 16, 2), x.name, "b", timeout=10)
        hr = w.put(pattern(1 << 16, 3), r.name, "b", timeout=0.5)
        hr.wait(5)
        assert torch.equal(r_buf, pattern(1 << 16, 3))
    hx.wait(5)
    assert torch.equal(x_buf, pattern(1 << 16, 2))


@pytest.mark.parametrize("kind", list(KINDS))
def test_close_of_the_writer_fails_in_flight_handles_and_wakes_their_waiters(loopback_net, kind):
    n, options = KINDS[kind]
    dst = torch.zeros(n, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", **options)
    w.put(pattern(n, 1), r.name, "dst").wait(5)
    seen: list[BaseException | None] = []
    waiting = threading.Event()
    raised: list[BaseException] = []

    def waiter(h: transport.Handle) -> None:
        waiting.set()
        try:
            h.wait()  # no timeout: only the close can end it while the peer is frozen
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            raised.append(e)

    with frozen(r):
        h = w.put(pattern(n, 2), r.name, "dst", notify=b"never")
        h.add_done_callback(lambda done: seen.append(done.exception(0)))
        thread = threading.Thread(target=waiter, args=(h,), daemon=True)
        thread.start()
        assert waiting.wait(5)
        w.close()
        thread.join(5)
        assert not thread.is_alive(), "close() did not wake the thread waiting on the handle"
    assert len(raised) == 1 and isinstance(raised[0], transport.ClosedError), raised
    assert isinstance(h.exception(0), transport.ClosedError)
    assert len(seen) == 1 and isinstance(seen[0], transport.ClosedError), seen
    assert torch.equal(dst, pattern(n, 1)), "a transfer failed by close() wrote into the region"
    with pytest.raises(transport.ClosedError, match="is closed; open a new Transport"):
        w.put(pattern(n, 3), r.name, "dst")
    w.close()  # idempotent
    # the receiver is unaffected: a new writer under another name reaches it
    w2 = loopback_net.make("w2")
    w2.put(pattern(n, 4), r.name, "dst", notify=b"w2").wait(5)
    assert torch.equal(dst, pattern(n, 4))
    note = r.wait_notification(5)
    assert (note.peer, note.payload) == (w2.name, b"w2")


def test_close_ends_the_notifications_iterator_and_wakes_wait_for_peer(loopback_net):
    dst = torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    got: list[tuple[transport.Notification, torch.Tensor]] = []
    outcomes: dict[str, BaseException | None] = {}
    first = threading.Event()

    def iterate() -> None:
        try:
            for note in r.notifications():  # no timeout: ends when the Transport closes
                got.append((note, dst.clone()))
                first.set()
            outcomes["notifications"] = None
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcomes["notifications"] = e

    def run(what: str, call: object) -> None:
        try:
            call()  # type: ignore[operator]
            outcomes[what] = None
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcomes[what] = e

    threads = [
        threading.Thread(target=iterate, daemon=True),
        threading.Thread(
            target=run,
            args=("wait_for_peer", lambda: r.wait_for_peer(loopback_net.name("late"), None)),
            daemon=True,
        ),
    ]
    for t in threads:
        t.start()
    w.put(pattern(4096, 1), r.name, "dst", notify=b"v1").wait(5)
    assert first.wait(5)
    r.close()
    for t in threads:
        t.join(5)
        assert not t.is_alive(), f"close() did not wake {t.name}"
    ((note, seen),) = got
    assert (note.peer, note.payload) == (w.name, b"v1")
    assert torch.equal(seen, pattern(4096, 1))  # the data was there when it was notified
    assert outcomes["notifications"] is None  # the iteration simply ends
    assert isinstance(outcomes["wait_for_peer"], transport.ClosedError)
    with pytest.raises(transport.ClosedError):
        r.wait_notification(0.01)


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
def test_close_wakes_a_thread_in_wait_notification_with_closed_error(
    loopback_net, monkeypatch, timeout
):
    dst = torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    second, blocked = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []
    real_wait = threading.Condition.wait

    def watched_wait(self: threading.Condition, wait_for: float | None = None) -> bool:
        # the waiter thread got as far as blocking on a condition: it is inside the wait, so
        # close() below lands during it (not before it began)
        if threading.current_thread() is thread and second.is_set():
            blocked.set()
        return real_wait(self, wait_for)

    def waiter() -> None:
        note = r.wait_notification(5)
        outcome.append(
            None
            if note.payload == b"v1" and torch.equal(dst, pattern(4096, 1))
            else AssertionError(f"first notification {note} or its bytes are wrong")
        )
        second.set()
        try:
            r.wait_notification(timeout, peer=w.name)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    thread = threading.Thread(target=waiter, daemon=True)
    monkeypatch.setattr(threading.Condition, "wait", watched_wait)
    thread.start()
    w.put(pattern(4096, 1), r.name, "dst", notify=b"v1").wait(5)
    assert blocked.wait(5)
    r.close()
    thread.join(5)
    assert not thread.is_alive(), "close() did not wake the thread in wait_notification"
    assert outcome[0] is None, outcome[0]
    assert isinstance(outcome[1], transport.ClosedError), repr(outcome[1])


class _Restart:
    """A receiver named "r" that is closed and started again under the same name."""

    def __init__(self, net, n: int) -> None:
        self.net, self.n = net, n
        self.old_buf = torch.zeros(n, dtype=torch.uint8)
        self.old = net.receiver("r", {"x": self.old_buf})

    def restart(self) -> tuple[transport.Transport, torch.Tensor]:
        self.old.close()
        buf = torch.zeros(self.n, dtype=torch.uint8)
        new = self.net.receiver("r", {"x": buf})
        assert new.name == self.old.name and new.generation > self.old.generation
        return new, buf


@pytest.mark.parametrize("kind", ["inline", "engine", "chunked", "batch"])
def test_a_peer_that_restarts_under_its_name_gets_the_next_put(loopback_net, kind):
    n, options = KINDS.get(kind, (1 << 16, {"chunk_bytes": 4096}))
    peer = _Restart(loopback_net, n)
    w = loopback_net.make("w", **options, **NO_HEARTBEAT)
    src = pattern(n, 1)

    def put(notify: bytes) -> transport.Handle:
        if kind == "batch":
            return w.put({"x": src}, peer.old.name, notify=notify)
        return w.put(src, peer.old.name, "x", notify=notify)

    put(b"v1").wait(5)  # planned against the first incarnation
    assert peer.old.wait_notification(5).payload == b"v1"
    assert torch.equal(peer.old_buf, pattern(n, 1))
    new, buf = peer.restart()
    src.copy_(pattern(n, 2))
    put(b"v2").wait(5)  # the same plan finds the old agent gone and goes to the new one
    assert torch.equal(buf, pattern(n, 2))
    note = new.wait_notification(5)
    assert (note.peer, note.payload) == (w.name, b"v2")
    assert torch.equal(peer.old_buf, pattern(n, 1))
    src.copy_(pattern(n, 3))
    put(b"v3").wait(5)
    assert torch.equal(buf, pattern(n, 3))
    assert new.wait_notification(5).payload == b"v3"


def test_a_get_from_a_peer_that_restarted_reads_the_new_incarnation(loopback_net):
    peer = _Restart(loopback_net, 4096)
    peer.old_buf.copy_(pattern(4096, 1))
    w = loopback_net.make("w", **NO_HEARTBEAT)
    dst = torch.zeros(4096, dtype=torch.uint8)
    w.get(dst, peer.old.name, "x").wait(5)
    assert torch.equal(dst, pattern(4096, 1))
    new, buf = peer.restart()
    buf.copy_(pattern(4096, 2))
    w.get(dst, new.name, "x").wait(5)
    assert torch.equal(dst, pattern(4096, 2))


def test_a_small_fan_out_with_a_restarted_peer_reaches_its_new_incarnation(loopback_net):
    a_buf = torch.zeros(1024, dtype=torch.uint8)
    a = loopback_net.receiver("a", {"x": a_buf})
    peer = _Restart(loopback_net, 1024)
    c_buf = torch.zeros(1024, dtype=torch.uint8)
    c = loopback_net.receiver("c", {"x": c_buf})
    names = [a.name, peer.old.name, c.name]
    w = loopback_net.make("w", **NO_HEARTBEAT)
    src = pattern(1024, 1)
    w.put(src, names, "x").wait(5)  # every plan cached: the next put takes the fast path
    assert torch.equal(peer.old_buf, src)
    _, buf = peer.restart()
    src.copy_(pattern(1024, 2))
    w.put(src, names, "x").wait(5)
    for b in (a_buf, buf, c_buf):
        assert torch.equal(b, pattern(1024, 2))
    assert torch.equal(peer.old_buf, pattern(1024, 1))


def test_a_bare_notify_to_a_restarted_peer_fails_once_then_reaches_it(loopback_net):
    peer = _Restart(loopback_net, 4096)
    w = loopback_net.make("w", **NO_HEARTBEAT)
    src = pattern(4096, 1)
    w.put(src, peer.old.name, "x").wait(5)
    w.notify(peer.old.name, b"after v1")
    assert peer.old.wait_notification(5).payload == b"after v1"
    new, buf = peer.restart()
    # the transfers this notification vouches for went to the old incarnation
    with pytest.raises(transport.PeerLostError, match="lost while notifying"):
        w.notify(new.name, b"stale")
    w.notify(new.name, b"fresh")
    assert new.wait_notification(5).payload == b"fresh"
    src.copy_(pattern(4096, 2))
    w.put(src, new.name, "x", notify=b"v2").wait(5)
    assert torch.equal(buf, pattern(4096, 2))
    assert new.wait_notification(5).payload == b"v2"


def test_a_new_tensor_to_a_restarted_peer_reaches_the_new_incarnation(loopback_net):
    peer = _Restart(loopback_net, 4096)
    w = loopback_net.make("w", **NO_HEARTBEAT)
    w.put(pattern(4096, 1), peer.old.name, "x").wait(5)  # connected to the first incarnation
    new, buf = peer.restart()
    w.put(pattern(4096, 2), new.name, "x").wait(5)
    assert torch.equal(buf, pattern(4096, 2))
