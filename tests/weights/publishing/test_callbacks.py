"""A publish handle's done-callbacks are the user's code: they run outside every lock of the
publisher, one that raises is logged and changes nothing else, and one may call the publisher
back (read its state, publish the next version and wait for it). On the loopback backend, for a
plain publisher and a sharded trainer's rank: version 2 is held in flight (a frozen generator)
while version 3 waits for its slot, so version 3 starts from the very completion whose
callbacks raise."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern
from transport.weights import ShardedPublisher, SourceLayout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]

N = 4096


def _publisher(net, kind, weights):
    trainer = net.make("trainer")
    if kind == "plain":
        return transport.WeightPublisher(trainer, weights, group="policy")
    layout = SourceLayout.split(1, {"w": ((N,), torch.uint8)})
    return ShardedPublisher(trainer, weights, layout, 0, group="policy")


@pytest.mark.parametrize("mode", ["staging", "inplace"])
@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_callbacks_that_raise_or_call_the_publisher_change_nothing_else(
    loopback_net, kind, mode, caplog
):
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(N, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy", mode=mode)
    weights = {"w": pattern(N, 1)}
    pub = _publisher(loopback_net, kind, weights)
    assert pub.publish(1, timeout=20).wait(20).done == [gen.name]
    sub.wait_for_version(1, timeout=10)

    seen: dict[str, object] = {}
    fourth = threading.Event()

    def boom(h):
        raise RuntimeError(f"a callback of version {h.result.version} fails")

    def reads(h):  # the publisher's state, from inside a callback
        seen["state"] = (pub.version, pub.subscribers(), h.result.done)

    def publishes(h):  # the next version, published and waited for from inside a callback
        try:
            weights["w"].copy_(pattern(N, 4))
            seen["fourth"] = pub.publish(4, timeout=20).wait(20)
        except BaseException as e:  # noqa: BLE001 - the test reports it below
            seen["fourth"] = e
        fourth.set()

    weights["w"].copy_(pattern(N, 2))
    with caplog.at_level(logging.ERROR, logger="transport.weights"), frozen(gen):
        second = pub.publish(2, timeout=30)  # in flight until the generator thaws
        third = pub.publish(3, timeout=30)  # waits for version 2 to end
        second.add_done_callback(boom)
        second.add_done_callback(reads)
        third.add_done_callback(boom)
        third.add_done_callback(publishes)
        assert not second.done() and not third.done()
    assert second.wait(20).done == [gen.name]
    assert third.wait(20).done == [gen.name]  # not excluded at its deadline: it started
    assert fourth.wait(30), "the callback that publishes never ended"
    result = seen["fourth"]
    assert isinstance(result, transport.PublishResult), result
    assert result.done == [gen.name]
    assert seen["state"] == (3, [gen.name], [gen.name])
    assert sub.wait_for_version(4, timeout=10) == 4
    assert sub.apply() == 4 and torch.equal(live["w"], pattern(N, 4))
    raised = [r for r in caplog.records if "done-callback" in r.getMessage()]
    assert len(raised) == 2, [r.getMessage() for r in caplog.records]
    # a callback added once the version is done runs at once; if it raises, that is logged
    second.add_done_callback(boom)
    pub.close()
    sub.close()
