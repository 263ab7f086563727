"""Heartbeats acted on (transport/liveness.py), on the loopback backend: a peer whose heartbeat
stopped is suspect in peers(), and not once it beats again.

A stopped heartbeat is written into the store as a stopped process leaves it (an old time of
the peer's generation): the real thing, SIGSTOP, is in tests/core/test_faults.py and
tests/weights/test_membership.py."""

from __future__ import annotations

import time

import pytest

import transport
from transport import liveness
from transport.wire import encode_heartbeat

pytestmark = pytest.mark.timeout(60)


def beat(t: transport.Transport, age: float) -> None:
    """Make the store hold a heartbeat of ``t`` written ``age`` seconds ago."""
    key = f"transport/{t.namespace}/hb/{t.name}"
    t.store.set(key, encode_heartbeat(t.generation, time.time() - age))


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
