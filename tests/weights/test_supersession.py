"""The one rule of supersession (weights/supersession.py) and both protocols keeping it: a
publisher's older version and a verl engine's older update are superseded by the newer one, and a
publisher's versions by a change of its tensors (updating())."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern
from transport import UpdateSupersededError
from transport.weights.buckets import Inbox
from transport.weights.supersession import Supersession

pytestmark = pytest.mark.unit

N = 4096


def test_only_the_key_begun_last_is_live():
    newest: Supersession[int] = Supersession()
    assert newest.live is None and newest.superseded(1)  # nothing begun: nothing is live
    assert newest.begin(1) is None and not newest.superseded(1)
    assert newest.begin(2) == 1
    assert newest.superseded(1) and not newest.superseded(2) and newest.live == 2


def test_an_engine_that_begins_another_update_supersedes_the_running_one(loopback_net):
    inbox = Inbox(loopback_net.make("writer"))
    try:
        inbox.begin("0" * 16)
        inbox.check("0" * 16)
        inbox.begin("1" * 16)
        with pytest.raises(UpdateSupersededError, match="superseded by update 1111"):
            inbox.check("0" * 16)
        with pytest.raises(UpdateSupersededError):
            inbox.post("0" * 16, lambda: pytest.fail("a superseded update must start no put"))
    finally:
        inbox.close()


def test_a_version_waiting_for_a_slot_is_never_started_once_the_tensors_change(loopback_net):
    """Version 2 is in flight to a frozen generator and version 3 waits for its slot; then the
    trainer changes its tensors inside updating(). When version 2 ends, version 3 must not start:
    the tensors hold other bytes now, which would land under its number. The next publish gives
    it up and lands whole."""
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(N, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy", mode="staging")
    weights = {"w": pattern(N, 1)}
    pub = transport.WeightPublisher(loopback_net.make("trainer"), weights, group="policy")
    try:
        assert pub.publish(1, timeout=20).wait(20).done == [gen.name]
        weights["w"].copy_(pattern(N, 2))
        with frozen(gen):
            second = pub.publish(2, timeout=30)  # in flight until the generator thaws
            # waits for version 2 to end; started then, it would be done at once (loopback)
            third = pub.publish(3, timeout=2)
            with pub.updating():
                weights["w"].copy_(pattern(N, 5))
        assert second.wait(20).done == [gen.name]
        assert third.wait(20).excluded == [gen.name], third.result  # at its deadline, unstarted
        fourth = pub.publish(4, timeout=20).wait(20)
        assert fourth.done == [gen.name]
        assert sub.wait_for_version(4, timeout=10) == 4
        assert sub.apply() == 4 and torch.equal(live["w"], pattern(N, 5))
    finally:
        pub.close()
        sub.close()
