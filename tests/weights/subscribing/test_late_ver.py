"""A version's notification that comes after a newer version began in the same slot completes
nothing: the slot then holds neither version whole. Seen in ``transport chaos``: a put that
crossed a cut link completed (its ``ver``) after the next version's relay had begun writing the
slot, and the generator applied the older version with the newer one's bytes in half its
tensors. On the loopback backend, the publisher's own Transport sends the messages a publisher
sends, in the order the run saw them."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.loopback_net import pattern
from transport.weights.group.messages import Begin, Ver, encode
from transport.weights.group.region_names import channel

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

N = 4096


def test_a_late_ver_of_a_version_overtaken_in_its_slot_completes_nothing(loopback_net) -> None:
    trainer, gen = loopback_net.make("trainer"), loopback_net.make("gen")
    seen: list[int] = []
    third = threading.Event()

    def updated(version: int) -> None:
        seen.append(version)
        if version == 3:
            third.set()

    live = {"w": torch.zeros(N, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy", on_update=updated)
    weights = {"w": pattern(N, 1)}
    pub = transport.WeightPublisher(trainer, weights, group="policy")
    assert pub.publish(1, timeout=20).wait(20).done == [gen.name]
    sub.wait_for_version(1, timeout=10)
    chan = channel("policy")
    for msg in (Begin(2, 1), Begin(3, 1), Ver(2, 1), Ver(3, 1)):  # in this order, one sender
        trainer.core.send_control(gen.name, chan, encode(msg))
    assert third.wait(30), "version 3 never completed"
    assert seen == [1, 3]  # version 2 never: slot 1 held part of version 3 by then
    assert sub.version == 3
