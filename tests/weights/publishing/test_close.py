"""Closing a weight publisher settles what waits on it: a publish in flight completes at once,
failed with ClosedError, instead of leaving ``handle.wait()`` (no timeout) blocked for good.
On the loopback backend: a frozen generator holds the version in flight for as long as needed."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


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


@pytest.mark.parametrize("mode", ["staging", "inplace"])
def test_a_closed_subscriber_gives_its_regions_back_and_a_new_one_of_the_group_is_served(
    loopback_net, mode
):
    """Closing a subscriber withdraws its regions (nothing of the group stays exposed), so a
    new subscriber of the same group on the same Transport (here of the other mode) exposes its
    own and receives every version, whole, though the publisher never saw the first one leave."""
    gen = loopback_net.make("gen")
    sub = transport.WeightSubscriber(
        gen, {"w": torch.zeros(4096, dtype=torch.uint8)}, group="policy", mode=mode
    )
    trainer = loopback_net.make("trainer")
    weights = {"w": pattern(4096, 1)}
    pub = transport.WeightPublisher(trainer, weights, group="policy")
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    sub.wait_for_version(1, timeout=10)
    sub.close()
    assert not [r for r in gen.regions() if r.startswith("policy@")], gen.regions()
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    other = "inplace" if mode == "staging" else "staging"
    again = transport.WeightSubscriber(gen, live, group="policy", mode=other)
    _versions_2_and_3(pub, weights, gen, again, live)
    again.close()
    pub.close()


def _versions_2_and_3(pub, weights, gen, sub, live) -> None:
    """``pub`` publishes versions 2 and 3 of ``weights`` to ``gen`` alone, and ``sub`` applies
    each into ``live`` whole."""
    for v in (2, 3):
        weights["w"].copy_(pattern(4096, v))
        assert pub.publish(v, timeout=10).wait(15).done == [gen.name]
        sub.wait_for_version(v, timeout=10)
        assert sub.apply() == v and torch.equal(live["w"], pattern(4096, v))


def test_a_closed_publisher_gives_its_regions_back_and_a_new_one_of_the_group_publishes(
    loopback_net,
):
    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    pub.close()
    assert trainer.regions() == {}
    mine = {"w": pattern(4096, 2)}
    again = transport.WeightPublisher(trainer, mine, group="policy")
    _versions_2_and_3(again, mine, gen, sub, live)
    assert sub.pull(trainer.name, timeout=10) == 3  # its own regions, read-only, for late joiners
    again.close()
    sub.close()


def test_a_closed_rank_of_a_sharded_trainer_is_replaced_on_the_same_transport(loopback_net):
    from transport.weights import ShardedPublisher, SourceLayout

    layout = SourceLayout.split(1, {"w": ((4096,), torch.uint8)})
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    trainer = loopback_net.make("trainer")
    weights = {"w": pattern(4096, 1)}
    rank = ShardedPublisher(trainer, weights, layout, 0, group="policy")
    assert rank.publish(1, timeout=10).wait(15).done == [gen.name]
    rank.close()
    again = ShardedPublisher(trainer, weights, layout, 0, group="policy")
    _versions_2_and_3(again, weights, gen, sub, live)
    again.close()
    sub.close()


def test_regions_a_close_could_not_withdraw_in_time_are_withdrawn_by_the_next_member(
    loopback_net, monkeypatch
):
    """A close whose withdrawal runs out of time (a peer that does not answer, a group of very
    many tensors) leaves regions exposed; the next subscriber of the group on that Transport
    withdraws them before it exposes its own."""
    from transport.weights.subscribing import subscriber as subscriber_module

    gen, sub, trainer, pub, weights, live = _pair(loopback_net)
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    monkeypatch.setattr(subscriber_module, "withdraw", lambda *args: list(args[1]))
    sub.close()  # gives up on every region: they stay exposed
    assert sorted(gen.regions()) == ["policy@0/w", "policy@1/w"]
    monkeypatch.undo()
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    again = transport.WeightSubscriber(gen, live, group="policy")
    weights["w"].copy_(pattern(4096, 2))
    assert pub.publish(2, timeout=10).wait(15).done == [gen.name]
    again.wait_for_version(2, timeout=10)
    assert again.apply() == 2 and torch.equal(live["w"], pattern(4096, 2))
    again.close()
    pub.close()
