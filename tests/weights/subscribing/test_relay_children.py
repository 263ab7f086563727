"""What a relay forwards to a child: never a version of no tensors. A restarted child whose
record does not show its slots yet would take such a forward's ``ver`` as a version it got, with
every element zero (found by transport chaos)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from transport import TransportError
from transport.weights.group.region_names import region
from transport.weights.subscribing.relay import Relay

pytestmark = pytest.mark.unit


def relay_seeing(regions: dict[str, object]) -> Relay:
    conn = SimpleNamespace(generation=7, regions=regions)
    core = SimpleNamespace(peer=lambda child, refresh=False: conn)
    live = {"w": torch.zeros(4)}
    return Relay(SimpleNamespace(core=core), "g", live, [live, live], host=None)


def test_a_child_that_shows_none_of_the_slots_fails_the_forward_and_is_read_again():
    relay = relay_seeing({"probe": None})  # its record shows a tensor of its own, no slot yet
    with pytest.raises(TransportError, match="none of group 'g'"):
        relay.child_names("gen1")
    assert "gen1" not in relay.children  # read again at the next forward


def test_a_child_that_shows_its_slots_takes_them():
    info = SimpleNamespace(nbytes=16, dtype="float32", shape=(4,))
    relay = relay_seeing({region("g", 0, "w"): info, region("g", 1, "w"): info})
    assert relay.child_names("gen1") == ["w"]
    assert relay.children["gen1"] == (7, ["w"])
