"""What a publish reads from the store: its lease, the group's epoch and each member's heartbeat,
together in one multi-key read (Store.reading_ahead), not one by one; and the next publish still
sees what changed in the store meanwhile. On the loopback backend, with the embedded store."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

import pytest
import torch

import transport
from helpers.loopback_net import pattern
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]


class CountingTcp(TcpStore):
    """The embedded store, counting what reaches its server: keys read one by one, and the
    multi-key reads, by the thread that made them."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", 0, hosting="yes")
        self.single: Counter[tuple[str, str]] = Counter()  # (thread name, key)
        self.many: list[tuple[str, list[str]]] = []
        self._count = threading.Lock()
        self.watching = False

    def _raw_try_get(self, client, key):  # noqa: ANN001, ANN202
        if self.watching:
            with self._count:
                self.single[(threading.current_thread().name, key)] += 1
        return super()._raw_try_get(client, key)

    def try_get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        keys = list(keys)
        if self.watching:
            with self._count:
                self.many.append((threading.current_thread().name, keys))
        return super().try_get_many(keys)


def test_a_publish_reads_its_lease_epoch_and_heartbeats_in_one_go():
    store = CountingTcp()
    made: list[transport.Transport] = []
    try:

        def make(name: str) -> transport.Transport:
            t = transport.Transport(name, store=store, backend="loopback", timeout=10)
            made.append(t)
            return t

        n = 64 << 10
        lives = {g: {"w": torch.zeros(n, dtype=torch.uint8)} for g in ("gen0", "gen1")}
        subs = [transport.WeightSubscriber(make(g), live) for g, live in lives.items()]
        trainer = make("trainer")
        weights = {"w": pattern(n, 1)}
        pub = transport.WeightPublisher(trainer, weights)
        assert sorted(pub.publish(1, timeout=10).wait(10).done) == ["gen0", "gen1"]
        store.watching = True
        weights["w"].copy_(pattern(n, 2))
        assert sorted(pub.publish(2, timeout=10).wait(10).done) == ["gen0", "gen1"]
        store.watching = False
        for sub in subs:
            sub.wait_for_version(2, timeout=10)
            sub.apply()
        assert all(torch.equal(live["w"], pattern(n, 2)) for live in lives.values())

        me = threading.current_thread().name
        assert len(store.many) == 1, store.many
        thread, keys = store.many[0]
        assert thread == me, thread
        group = "transport/default/groups/policy/"
        want = [group + "lease", group + "ranks", group + "epoch"]
        hearts = ["transport/default/hb/gen0", "transport/default/hb/gen1"]
        assert keys[:3] == want and sorted(keys[3:]) == hearts, keys
        read_singly = {k for (who, k), _ in store.single.items() if who == me}
        assert not read_singly & set(keys), read_singly  # none of them read again one by one

        # what changed in the store between two publishes is seen by the next: a member that
        # left is no longer written
        subs[1].close()
        weights["w"].copy_(pattern(n, 3))
        assert pub.publish(3, timeout=10).wait(10).done == ["gen0"]
        subs[0].wait_for_version(3, timeout=10)
        subs[0].apply()
        assert torch.equal(lives["gen0"]["w"], pattern(n, 3))
        pub.close()
        subs[0].close()
    finally:
        for t in reversed(made):
            t.close()
        store.close()
