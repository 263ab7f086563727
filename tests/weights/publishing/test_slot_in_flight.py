"""A slot the publisher is writing, or may still be writing, is handed to no other write.

Two ways it was handed out before (found by ``transport chaos``: a generator applied a version
with the next version's bytes in its last tensors, written into the same slot by a relay while
the publisher's own write of it was still landing):

* a credit that comes while a write is in flight and names that slot (a subscriber lists every
  slot it does not hold a version in, the one being written too) was taken as a credit for the
  next write, which then went into the slot the first write had just filled;
* a write that ended at its deadline is given up, not withdrawn: its bytes may still land once
  the link comes back, so the slot stays fenced for relays until a later write of ours to the
  subscriber landed (one connection delivers in order: our own writes may use it), and the
  subscriber still gets every later version.

On the loopback backend; the generator's transfers held as a stopped process holds them.
"""

from __future__ import annotations

import time

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern
from helpers.polling import wait_until
from transport.weights.group.group_directory import GroupEntry
from transport.weights.group.messages import Credit, encode
from transport.weights.group.region_names import channel
from transport.weights.publishing.members import Fence, PublisherMember

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

N = 4096


def plans(t: transport.Transport, op: str, peer: str) -> list[str]:
    """What the publisher's flight recorder says it did (``op``) for ``peer``, in order."""
    return [
        e["info"]
        for e in t.recorder.events()
        if e["kind"] == "ws-plan" and e["op"] == op and peer in e["peers"]
    ]


def slot_of(t: transport.Transport, peer: str, version: int) -> int:
    """The slot of ``peer`` that ``version`` was planned into (``ws-plan`` ``start``)."""
    (info,) = [i for i in plans(t, "start", peer) if i.startswith(f"v{version} ")]
    return int(info.split()[2])


def one_subscriber(loopback_net):
    """A trainer publishing version 1 of one tensor (group ``policy``) to one generator, which
    has it: (trainer, its tensors, publisher, generator, its live tensors, subscriber)."""
    trainer = loopback_net.make("trainer")
    weights = {"w": pattern(N, 1)}
    pub = transport.WeightPublisher(trainer, weights, group="policy")
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(N, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    return trainer, weights, pub, gen, live, sub


def test_a_credit_naming_the_slot_being_written_does_not_hand_it_to_the_next_version(
    loopback_net,
):
    trainer, weights, pub, gen, live, sub = one_subscriber(loopback_net)
    weights["w"].copy_(pattern(N, 2))
    with frozen(gen):
        second = pub.publish(2, timeout=60)
        wait_until(lambda: plans(trainer, "start", gen.name)[1:], 10, "version 2 planned")
        busy = slot_of(trainer, gen.name, 2)
        # what a subscriber that holds version 2 already (from a relay, or from the publisher
        # incarnation before this one) says while this write is in flight: every slot it
        # holds no version in, the one being written too
        stale = Credit((busy,), 2, 2)

        def read() -> list[str]:
            return [i for i in plans(trainer, "credit", gen.name) if i.startswith(repr(stale))]

        # a newer credit from the generator itself may replace ours before the publisher reads
        # it (only a subscriber's newest credit counts): said again until it was read
        end = time.monotonic() + 30
        while not read() and time.monotonic() < end:
            gen.core.send_control(trainer.name, channel("policy"), encode(stale))
            try:
                wait_until(read, 1, "the credit read")
            except AssertionError:
                continue
        assert read() and set(read()) == {f"{stale!r} ignored=False"}, read()
        third = pub.publish(3, timeout=60)  # waits for the slot; starts once version 2 landed
    assert second.wait(10).done == [gen.name]
    assert third.wait(10).done == [gen.name]
    assert slot_of(trainer, gen.name, 3) != busy, plans(trainer, "start", gen.name)
    sub.wait_for_version(3, timeout=10)
    assert sub.apply() == 3 and torch.equal(live["w"], pattern(N, 2))
    with sub.read(3) as snap:
        assert torch.equal(snap.tensors["w"], pattern(N, 2))
    pub.close()
    sub.close()


def test_a_write_given_up_at_its_deadline_fences_its_slot_and_later_versions_still_arrive(
    loopback_net,
):
    trainer, weights, pub, gen, live, sub = one_subscriber(loopback_net)
    sub.wait_for_version(1, timeout=10)
    assert sub.apply() == 1
    weights["w"].copy_(pattern(N, 2))
    with frozen(gen):
        result = pub.publish(2, timeout=0.5).wait(10)
    assert result.excluded == [gen.name], result
    given_up = slot_of(trainer, gen.name, 2)
    assert plans(trainer, "fence", gen.name) == [f"v2 slot {given_up}: unsure"]
    for version in (3, 4, 5):
        weights["w"].copy_(pattern(N, version))
        assert pub.publish(version, timeout=10).wait(20).done == [gen.name], version
        sub.wait_for_version(version, timeout=10)
        assert sub.apply() == version and torch.equal(live["w"], pattern(N, version))
    pub.close()
    sub.close()


def test_a_slot_fenced_for_our_own_write_is_fenced_for_relays_only_until_a_later_write_lands():
    sub = PublisherMember("gen", GroupEntry(7, 0, "staging", 2, True))
    sub.credits.say([0, 1])
    sub.fenced[0] = Fence(None, 5)  # our write of version 5 there was given up
    assert sub.free_slot(direct=False) == 1  # a relay writes the other one
    assert sub.free_slot(direct=True) == 0  # ours go over the connection that carries 5's bytes
    sub.fenced[1] = Fence("gen-r", 6)  # a relay cut off while writing version 6 there
    assert sub.free_slot(direct=False) is None
    assert sub.free_slot(direct=True) == 0
    sub.unfence(None, 4)  # a write of ours of an older version landed: 5's may still come
    assert 0 in sub.fenced
    sub.unfence(None, 6)  # a later one landed: 5's bytes came before it
    assert sub.fenced == {1: Fence("gen-r", 6)}
    sub.unfence("gen-r", 6)
    assert sub.free_slot(direct=False) == 0
    assert "may still be landing" not in sub.no_slot(7)
    sub.fenced[1] = Fence(None, 8)
    assert "our write of version 8 there may still be landing" in sub.no_slot(9)
