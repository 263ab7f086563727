"""One publisher per weight group: a second publisher, in another Transport (another process in
real use), fails at construction naming the holder, and takes over once the holder is gone: it
closed, its Transport left, it restarted under its name, or its heartbeat stopped. Two
publishers handing out the same slots tore versions; with the lease they cannot coexist."""

from __future__ import annotations

import time

import pytest
import torch

import transport
from helpers.loopback_net import pattern
from transport.peers import liveness
from transport.peers.directory import Directory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _gen(net):
    gen = net.make("gen")
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    return gen, transport.WeightSubscriber(gen, live, group="policy"), live


def _publishes(t, sub, live, seed: int, version: int) -> None:
    pub = transport.WeightPublisher(t, {"w": pattern(4096, seed)}, group="policy")
    try:
        assert pub.publish(version, timeout=10).wait(10).done == [sub.transport.name]
        sub.wait_for_version(version, timeout=10)
        assert sub.apply() == version and torch.equal(live["w"], pattern(4096, seed))
    finally:
        pub.close()


def test_a_second_publisher_is_refused_naming_the_holder_until_the_first_closes(loopback_net):
    gen, sub, live = _gen(loopback_net)
    a, b = loopback_net.make("trainer-a"), loopback_net.make("trainer-b")
    first = transport.WeightPublisher(a, {"w": pattern(4096, 1)}, group="policy")
    with pytest.raises(transport.GroupBusyError, match=f"{a.name}.*generation {a.generation}"):
        transport.WeightPublisher(b, {"w": pattern(4096, 2)}, group="policy")
    assert b.regions() == {}  # refused before anything was exposed
    assert first.publish(1, timeout=10).wait(10).done == [gen.name]
    first.close()
    _publishes(b, sub, live, seed=2, version=2)  # the lease was given back
    sub.close()


def test_a_publisher_whose_transport_left_or_restarted_is_taken_over(loopback_net):
    gen, sub, live = _gen(loopback_net)
    a, b = loopback_net.make("trainer-a"), loopback_net.make("trainer-b")
    transport.WeightPublisher(a, {"w": pattern(4096, 1)}, group="policy")  # never closed
    a.close()  # its record leaves the store: the holder is gone
    _publishes(b, sub, live, seed=3, version=1)
    # a holder that restarts under its name: the new incarnation takes over from the old one
    c = loopback_net.make("trainer-c")
    transport.WeightPublisher(c, {"w": pattern(4096, 4)}, group="policy")  # held, never closed
    c2 = loopback_net.make("trainer-c")  # the same name again: the next generation
    assert c2.generation == c.generation + 1
    _publishes(c2, sub, live, seed=5, version=2)
    sub.close()


def test_a_holder_whose_heartbeat_stopped_is_taken_over(loopback_net):
    """Past the *gone* bar of transport/peers/liveness.py, not merely past the suspect one: a takeover
    cannot be undone. The stopped heartbeat is written as a stopped holder leaves it."""
    gen, sub, live = _gen(loopback_net)
    a = loopback_net.make("trainer-a", heartbeat_interval=3600)  # one beat, at its start
    transport.WeightPublisher(a, {"w": pattern(4096, 1)}, group="policy")
    b = loopback_net.make("trainer-b")
    with pytest.raises(transport.GroupBusyError, match="alive"):
        transport.WeightPublisher(b, {"w": pattern(4096, 2)}, group="policy")
    beats = Directory(loopback_net.store, a.namespace, None)
    suspect = liveness.stale_after(b.heartbeat_interval) + 1
    gone = liveness.stale_after(b.heartbeat_interval, liveness.GONE_BEATS, liveness.GONE_MIN_S)
    assert suspect < gone
    beats.heartbeat(a.name, a.generation, at=time.time() - suspect)
    assert {i.name: i for i in b.peers()}[a.name].suspect  # suspect, but not gone yet
    with pytest.raises(transport.GroupBusyError, match="alive"):
        transport.WeightPublisher(b, {"w": pattern(4096, 2)}, group="policy")
    beats.heartbeat(a.name, a.generation, at=time.time() - gone - 1)
    _publishes(b, sub, live, seed=6, version=1)
    sub.close()


def test_garbage_in_the_lease_is_replaced(loopback_net, caplog):
    gen, sub, live = _gen(loopback_net)
    t = loopback_net.make("trainer")
    loopback_net.store.set(f"transport/{t.namespace}/groups/policy/lease", b"\xc1garbage")
    _publishes(t, sub, live, seed=7, version=1)
    assert "malformed publisher lease" in caplog.text
    sub.close()
