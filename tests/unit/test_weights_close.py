"""Closing a weight publisher settles what waits on it: a publish in flight completes at once,
failed with ClosedError, instead of leaving ``handle.wait()`` (no timeout) blocked for good.
On the loopback backend: a frozen generator holds the version in flight for as long as needed."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern

pytestmark = pytest.mark.timeout(30)


def _pair(net):
    gen = net.make("gen")
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy", mode="staging")
    trainer = net.make("trainer")
    weights = {"w": pattern(4096, 1)}
    pub = transport.WeightPublisher(trainer, weights, group="policy")
    return gen, sub, trainer, pub, weights, live


def test_close_fails_a_publish_in_flight_and_wakes_its_waiter(loopback_net):
    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    sub.wait_for_version(1, timeout=10)
    weights["w"].copy_(pattern(4096, 2))
    ended: list[BaseException | None] = []
    waited = threading.Event()
    with frozen(gen):  # version 2 cannot land
        handle = pub.publish(2, timeout=60)

        def wait_forever() -> None:
            try:
                handle.wait()  # no timeout, as the README shows it
                ended.append(None)
            except BaseException as e:  # noqa: BLE001 - the test checks what it was
                ended.append(e)
            waited.set()

        threading.Thread(target=wait_forever, daemon=True).start()
        assert not handle.done()
        pub.close()
        assert waited.wait(10), "handle.wait() still blocked after the publisher closed"
    assert len(ended) == 1 and isinstance(ended[0], transport.ClosedError)
    assert "closed" in str(ended[0]) and handle.done()
    assert isinstance(handle.exception(0), transport.ClosedError)
    # what was posted before the close may still land once the generator runs again: whichever
    # version it completed, it applies that version whole
    v = sub.apply()
    assert v in (1, 2) and torch.equal(live["w"], pattern(4096, v))
    sub.close()


def test_close_after_a_completed_publish_changes_nothing(loopback_net):
    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    handle = pub.publish(1, timeout=10)
    assert handle.wait(10).done == [gen.name]
    pub.close()
    assert handle.exception(0) is None and handle.wait(0).done == [gen.name]
    sub.close()


def test_a_second_subscriber_of_a_group_on_one_transport_is_refused_and_changes_nothing(
    loopback_net,
):
    """Refused before it changes any state: the first subscriber keeps receiving versions, and
    the refused one leaves no thread behind."""
    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    before = {t.name for t in threading.enumerate()}
    exposed = set(gen.regions())
    with pytest.raises(ValueError, match="already has a handler"):
        transport.WeightSubscriber(gen, {"w": torch.zeros(4096, dtype=torch.uint8)}, group="policy")
    assert {t.name for t in threading.enumerate()} <= before
    assert set(gen.regions()) == exposed  # nothing more exposed
    weights["w"].copy_(pattern(4096, 5))
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    sub.wait_for_version(1, timeout=10)
    assert sub.apply() == 1 and torch.equal(live["w"], pattern(4096, 5))
    sub.close()


def test_a_publisher_of_a_group_this_transport_subscribes_to_is_refused_and_changes_nothing(
    loopback_net,
):
    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    before = {t.name for t in threading.enumerate()}
    exposed = set(gen.regions())
    with pytest.raises(ValueError, match="already has a handler"):
        transport.WeightPublisher(gen, {"w": pattern(4096, 9)}, group="policy")
    assert {t.name for t in threading.enumerate()} <= before
    assert set(gen.regions()) == exposed
    with pytest.raises(ValueError, match="already has a handler"):  # a second publisher
        transport.WeightPublisher(trainer, {"w": pattern(4096, 9)}, group="policy")
    assert {t.name for t in threading.enumerate()} <= before
    weights["w"].copy_(pattern(4096, 6))
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]  # the first one still works
    sub.wait_for_version(1, timeout=10)
    assert sub.apply() == 1 and torch.equal(live["w"], pattern(4096, 6))
    sub.close()
