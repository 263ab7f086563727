"""A late joiner pulls the newest version straight from the publisher while the trainer keeps going."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from transport.weights.publishing.pack import packable

LARGE = {f"layers.{i}.w": (256, 256) for i in range(16)}  # 4 MiB
# 16 large tensors among 512 small ones, which the publisher copies into one buffer at each
# publish (weights/publishing/pack.py): a pull reads that copy, never a state between two publishes
MIXED = {
    **{f"layers.{i}.{r}": (64 + i % 5,) for i in range(128) for r in ("q", "k", "norm", "bias")},
    **LARGE,
}


@pytest.mark.parametrize("shapes", [LARGE, MIXED], ids=["large", "packed"])
def test_pull_reads_a_consistent_version_while_training_goes_on(tcp_store, trainer, shapes):
    weights = {k: torch.zeros(s) for k, s in shapes.items()}
    if shapes is MIXED:
        assert len(packable(weights)) == 512
    pub = transport.WeightPublisher(trainer, weights)
    stop, first = threading.Event(), threading.Event()
    steps = []
    # the steps the trainer may take: each pull lets three more race with it. Unbounded, a
    # trainer faster than a pull on a loaded machine would leave it no quiet moment at all.
    permits = threading.Semaphore(3)

    def train() -> None:
        v = 0
        while not stop.is_set():
            if not permits.acquire(timeout=0.05):
                continue
            v += 1
            with pub.updating():  # the optimizer step
                for t in weights.values():
                    t.fill_(float(v))
            pub.publish(v, timeout=10).wait(20)
            steps.append(v)
            first.set()

    th = threading.Thread(target=train)
    th.start()
    try:
        with transport.Transport("late", store=tcp_store) as late:
            sub = transport.WeightSubscriber(late, {k: torch.zeros(s) for k, s in shapes.items()})
            assert first.wait(30)
            seen = []
            for _ in range(100):
                for _ in range(3):
                    permits.release()  # three steps race with this pull
                v = sub.pull("trainer", timeout=20)
                values = {float(t.min()) for t in sub.live.values()} | {
                    float(t.max()) for t in sub.live.values()
                }
                assert values == {float(v)}, (
                    f"pulled version {v} but the tensors hold {sorted(values)[:5]}"
                )
                seen.append(v)
            assert seen == sorted(seen) and seen[-1] > seen[0]  # the trainer moved on meanwhile
            assert sub.applied_version == seen[-1]
            sub.close()
    finally:
        stop.set()
        th.join(30)
        pub.close()
    assert len(steps) > 10


def test_pull_without_updating_brackets_or_versions_times_out(tcp_store, trainer):
    weights = {"w": torch.zeros(64)}
    pub = transport.WeightPublisher(trainer, weights)
    with transport.Transport("late", store=tcp_store) as late:
        sub = transport.WeightSubscriber(late, {"w": torch.zeros(64)})
        with pytest.raises(transport.TransferTimeout, match="never called publish"):
            sub.pull("trainer", timeout=0.3)  # nothing published yet: no version to take
        pub.publish(1).wait(10)
        assert sub.pull("trainer", timeout=5) == 1
        sub.close()
    pub.close()


def test_publisher_that_knew_the_peer_before_it_subscribed_still_serves_it(tcp_store, trainer):
    """The trainer's Transport talked to the generator before the generator subscribed: the
    publisher must read the generator's record afresh, not plan against the cached one."""
    with transport.Transport("gen-0", store=tcp_store) as gen:
        hello = torch.zeros(4)
        gen.expose("hello", hello)
        trainer.wait_for_peer("gen-0", 10, regions=["hello"])
        trainer.put(torch.ones(4), "gen-0", "hello").wait(10)  # connected and cached
        assert torch.equal(hello, torch.ones(4))
        live = {"w": torch.zeros(128)}
        sub = transport.WeightSubscriber(gen, live, mode="inplace")
        weights = {"w": torch.full((128,), 3.0)}
        pub = transport.WeightPublisher(trainer, weights)
        result = pub.publish(1, timeout=10).wait(20)
        assert result.done == ["gen-0"], result.reasons
        assert sub.wait_for_version(1, 10) == 1 and torch.equal(live["w"], weights["w"])
        sub.close()
        pub.close()
