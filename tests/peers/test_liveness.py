"""Heartbeats acted on (transport/peers/liveness.py), on the loopback backend: a peer whose heartbeat
stopped is suspect in peers(), a weight publisher excludes a suspect subscriber at once and
serves it again once it beats; a subscriber planned while the store had lost its record is
planned again, and one whose group entry the store lost is served until it joins again.

A stopped heartbeat is written into the store as a stopped process leaves it (an old time of
the peer's generation): the real thing, SIGSTOP, is in tests/core/test_faults.py and
tests/weights/group/test_membership.py."""

from __future__ import annotations

import time

import pytest
import torch

import transport
from helpers import internals
from helpers.loopback_net import pattern
from helpers.polling import wait_until
from transport.peers import liveness
from transport.peers.directory import Directory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def beat(t: transport.Transport, age: float) -> None:
    """Make the store hold a heartbeat of ``t`` written ``age`` seconds ago."""
    Directory(t.store, t.namespace, None).heartbeat(t.name, t.generation, at=time.time() - age)


def too_old(t: transport.Transport) -> float:
    """An age past the suspect bar of ``t`` (what peers() and its publishers judge with)."""
    return liveness.stale_after(t.heartbeat_interval) + 30


def test_the_bars_have_a_floor_in_seconds_and_scale_with_the_interval():
    now = 1000.0
    assert liveness.stale_after(0.1) == liveness.SUSPECT_MIN_S  # a short interval: the floor
    assert liveness.stale_after(10.0) == 10.0 * liveness.SUSPECT_BEATS
    assert liveness.stale_after(
        1.0, liveness.GONE_BEATS, liveness.GONE_MIN_S
    ) > liveness.stale_after(1.0)
    assert liveness.staleness(now - 4.9, 1.0, now=now) is None
    why = liveness.staleness(now - 7.25, 1.0, now=now)
    assert why is not None and "7.2 s old" in why and "more than 5 s" in why
    # the heartbeat of the incarnation asked about counts; none yet, or an older one's, is no sign
    assert liveness.suspicion(None, 3, 1.0, now) is None
    assert liveness.suspicion((2, now - 100), 3, 1.0, now) is None
    assert liveness.suspicion((3, now - 1), 3, 1.0, now) is None
    assert "s old" in (liveness.suspicion((3, now - 100), 3, 1.0, now) or "")
    assert "restarted" in (liveness.suspicion((4, now), 3, 1.0, now) or "")
    # a stale heartbeat of a peer that sent the reader a message within the bar: not suspect
    assert liveness.suspicion((3, now - 100), 3, 1.0, now, heard=now - 4.9) is None
    assert "s old" in (liveness.suspicion((3, now - 100), 3, 1.0, now, heard=now - 7) or "")
    assert "restarted" in (liveness.suspicion((4, now), 3, 1.0, now, heard=now) or "")


def test_a_peer_whose_heartbeat_stopped_is_suspect_until_it_beats_again(loopback_net):
    quiet = loopback_net.make("quiet", heartbeat_interval=3600)  # one beat, at its start
    obs = loopback_net.make("obs")

    def info(name: str) -> transport.PeerInfo:
        return {i.name: i for i in obs.peers()}[name]

    assert info(quiet.name).suspect is None and info(obs.name).suspect is None
    beat(quiet, too_old(obs))
    why = info(quiet.name).suspect
    assert why is not None and "heartbeat" in why and "s old" in why, why
    assert info(obs.name).suspect is None
    assert "heartbeat" in (obs.wait_for_peer(quiet.name, timeout=0).suspect or "")
    assert obs.core.suspect(quiet.name, quiet.generation) is not None
    # just under the bar: not suspect (the floor, not a single late beat, decides)
    beat(quiet, liveness.stale_after(obs.heartbeat_interval) - 2)
    assert info(quiet.name).suspect is None
    beat(quiet, 0)
    assert info(quiet.name).suspect is None
    assert obs.core.suspect(quiet.name, quiet.generation) is None


def test_a_peer_that_answered_is_not_suspect_though_its_heartbeat_runs_late(loopback_net):
    """A busy process's heartbeat thread may run seconds late while its engine still answers:
    a message it sent within the bar outweighs a stale heartbeat; silent past the bar too, it
    is suspect again."""
    busy = loopback_net.make("busy", heartbeat_interval=3600)
    obs = loopback_net.make("obs")
    beat(busy, too_old(obs))
    assert obs.core.suspect(busy.name, busy.generation) is not None
    busy.notify(obs.name, b"still here")
    assert obs.wait_notification(timeout=10, peer=busy.name).payload == b"still here"
    assert obs.core.suspect(busy.name, busy.generation) is None
    assert {i.name: i.suspect for i in obs.peers()}[busy.name] is None
    assert obs.wait_for_peer(busy.name, timeout=0).suspect is None
    internals.deaf_to(obs, busy.name)
    why = obs.core.suspect(busy.name, busy.generation)
    assert why is not None and "s old" in why, why


def test_a_suspect_subscriber_is_excluded_at_once_and_served_once_it_beats(loopback_net):
    gen = loopback_net.make("gen", heartbeat_interval=3600)
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    trainer = loopback_net.make("trainer")
    src = {"w": pattern(4096, 1)}
    pub = transport.WeightPublisher(trainer, src, group="policy")
    try:
        assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
        beat(gen, too_old(trainer))
        internals.deaf_to(trainer, gen.name)  # it answered version 1, and stopped
        src["w"].copy_(pattern(4096, 2))
        h = pub.publish(2, timeout=600)
        # settled by publish() itself: nothing waits for the deadline ten minutes away
        assert h.result.status == {gen.name: "excluded"}
        why = h.wait(10).reasons[gen.name]
        assert why.startswith("suspect:") and "heartbeat" in why and "next publish" in why, why
        beat(gen, 0)  # it beats again: a member again
        src["w"].copy_(pattern(4096, 3))
        assert pub.publish(3, timeout=10).wait(10).done == [gen.name]
        assert sub.wait_for_version(3, timeout=10) == 3
        assert sub.apply() == 3 and torch.equal(live["w"], pattern(4096, 3))
    finally:
        pub.close()
        sub.close()


def test_a_subscriber_planned_while_the_store_lost_its_record_is_planned_again(loopback_net):
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    trainer = loopback_net.make("trainer")
    release = internals.hold_record_restore(gen)
    internals.empty_memory_store(loopback_net.store)  # a Redis without persistence restarted
    # the subscriber joins the group again (its entry check) before its record is back
    wait_until(lambda: internals.group_entry(trainer, "policy", gen.name), 10, "the entry back")
    assert gen.name not in {i.name for i in trainer.peers()}
    src = {"w": pattern(4096, 4)}
    pub = transport.WeightPublisher(trainer, src, group="policy")  # planned now: no record
    try:
        r = pub.publish(1, timeout=2).wait(10)  # planned again until the deadline
        assert r.status == {gen.name: "excluded"}, r.reasons
        assert f"no peer named {gen.name!r}" in r.reasons[gen.name], r.reasons
        assert "tried again until the deadline" in r.reasons[gen.name], r.reasons
        release()
        wait_until(lambda: gen.name in {i.name for i in trainer.peers()}, 10, "the record back")
        assert pub.publish(2, timeout=10).wait(10).done == [gen.name]
        assert sub.wait_for_version(2, timeout=10) == 2
        assert sub.apply() == 2 and torch.equal(live["w"], pattern(4096, 4))
    finally:
        pub.close()
        sub.close()


def test_subscribers_whose_entries_the_store_lost_are_served_until_they_join_again(loopback_net):
    gen = loopback_net.make("gen")
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    trainer = loopback_net.make("trainer")
    src = {"w": pattern(4096, 5)}
    pub = transport.WeightPublisher(trainer, src, group="policy")
    try:
        assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
        internals.empty_memory_store(loopback_net.store)
        # right after the loss, before anyone put anything back: served over its connection
        src["w"].copy_(pattern(4096, 6))
        r = pub.publish(2, timeout=10).wait(10)
        assert r.status == {gen.name: "done"}, r.reasons
        assert sub.wait_for_version(2, timeout=10) == 2
        assert sub.apply() == 2 and torch.equal(live["w"], pattern(4096, 6))
        wait_until(lambda: internals.group_entry(trainer, "policy", gen.name), 10, "the entry back")
        src["w"].copy_(pattern(4096, 7))
        assert pub.publish(3, timeout=10).wait(10).done == [gen.name]
        assert sub.wait_for_version(3, timeout=10) == 3
        assert sub.apply() == 3 and torch.equal(live["w"], pattern(4096, 7))
    finally:
        pub.close()
        sub.close()
