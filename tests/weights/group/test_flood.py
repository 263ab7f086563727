"""A peer that floods a weight group's channel: the work its messages may queue is bounded, and
a subscriber checks a sender that is not the group's publisher or a relay once (a few store
reads), then refuses its messages without reading the store, whatever their number; the next
version still completes. On the loopback backend."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.loopback_net import pattern
from helpers.polling import wait_until
from helpers.stores import ForwardingStore
from transport import Store
from transport.weights.group.messages import Begin, Credit, Hello, Ver, encode
from transport.weights.group.worker import Worker
from transport.weights.subscribing.upstream import MAX_HELD_PER_SENDER

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]

N = 4096
FLOOD = 5000


class CountingStore(ForwardingStore):
    """``inner`` as it is, counting the reads made through it (the owner closes ``inner``)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.reads = 0
        self._lock = threading.Lock()

    def _read(self) -> None:
        with self._lock:
            self.reads += 1

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self._read()
        return super().get(key, timeout)

    def try_get(self, key: str) -> bytes | None:
        self._read()
        return super().try_get(key)

    def exists(self, key: str) -> bool:
        self._read()
        return super().exists(key)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        self._read()
        return super().compare_set(key, expected, desired)

    def compare_delete(self, key: str, expected: bytes) -> bool:
        self._read()
        return super().compare_delete(key, expected)


def test_a_flood_from_a_peer_that_is_not_the_publisher_costs_bounded_memory_and_reads(
    loopback_net,
):
    store = CountingStore(loopback_net.store)
    gen = transport.Transport(loopback_net.name("gen"), store=store, backend="loopback", timeout=10)
    loopback_net.made.append(gen)
    entered, release = threading.Event(), threading.Event()

    def on_update(version: int) -> None:  # holds the subscriber's worker while version 1 is new
        if version == 1:
            entered.set()
            release.wait(60)

    live = {"w": torch.zeros(N, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy", on_update=on_update)
    weights = {"w": pattern(N, 1)}
    pub = transport.WeightPublisher(loopback_net.make("trainer"), weights, group="policy")
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    assert entered.wait(10)
    flooder = loopback_net.make("flooder")
    kinds = [Hello(), Begin(7, 0), Ver(7, 0), Credit((0, 1), 7, 7)]
    before = store.reads
    try:
        for i in range(FLOOD):
            flooder.core.send_control(gen.name, "ws/policy", encode(kinds[i % len(kinds)]))
        # its worker busy, the subscriber holds a bounded number of the messages for the check
        # of their sender and refuses the rest on receipt: nothing else is queued
        wait_until(
            lambda: sub.refused_messages >= FLOOD - MAX_HELD_PER_SENDER, 30, "the flood refused"
        )
    finally:
        release.set()
    wait_until(lambda: sub.refused_messages == FLOOD, 30, "every message of the flood refused")
    reads = store.reads - before
    assert reads < 100, f"{reads} store reads for {FLOOD} messages"
    # its verdict stands: more messages cost no reads (no check within REFRESH_S of the last)
    before = store.reads
    for _ in range(500):
        flooder.core.send_control(gen.name, "ws/policy", encode(Hello()))
    wait_until(lambda: sub.refused_messages == FLOOD + 500, 30, "the second flood refused")
    assert store.reads - before < 20
    assert sub.version == 1  # nothing of what it sent was taken for a version
    weights["w"].copy_(pattern(N, 2))
    assert pub.publish(2, timeout=10).wait(20).done == [gen.name]
    sub.wait_for_version(2, timeout=10)
    assert sub.apply() == 2 and torch.equal(live["w"], pattern(N, 2))
    sub.close()
    pub.close()


def test_the_work_peers_queue_is_bounded_and_the_newest_credit_is_kept():
    """The worker's rule (weights/group/worker.py): its own work is never dropped, work a peer's
    message asks for is dropped past the limit (counted), and the work that reads only the
    newest message of a key is queued once per key, reading the newest."""
    release, ran = threading.Event(), []
    worker = Worker("test-flood", limit=8)
    try:
        worker.submit(lambda: release.wait(30))  # holds the thread
        for i in range(100):
            worker.latest("credit", i, lambda v: ran.append(("latest", v)))
        for i in range(20):
            worker.offer(lambda i=i: ran.append(("offer", i)))
        for i in range(30):
            worker.submit(lambda i=i: ran.append(("own", i)))
        assert worker.dropped == 20 - 7  # 1 key and 7 offered fill the limit of 8
        release.set()
        done = threading.Event()
        worker.submit(done.set)
        assert done.wait(10)
    finally:
        release.set()
        worker.stop()
    assert [x for x in ran if x[0] == "offer"] == [("offer", i) for i in range(7)]
    assert [x for x in ran if x[0] == "latest"] == [("latest", 99)]
    assert [x for x in ran if x[0] == "own"] == [("own", i) for i in range(30)]
