"""Fault drills with a namespace secret: every incarnation's frames are sealed, so what a kill, a
freeze or a restart does to connections must never leave a receiver refusing a live peer's frames.

A publisher killed mid-publish and restarted, a subscriber killed and restarted under its name,
a subscriber frozen (SIGSTOP) through a publish and resumed: after each, every version
completes at every live subscriber, with every element of version N holding N, and nobody
refused a frame of a live peer where that can be read (refusals are what a reconnect bug looks
like with a secret)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

import transport
from helpers.polling import wait_until
from helpers.ws_peer import (
    MiB,
    PublisherProcess,
    SubscriberProcess,
    make_tensors,
    publish_served,
    spec_of,
)

pytestmark = pytest.mark.timeout(300)

SECRET = b"the-drill-secret"


def everywhere(names, value):
    return {n: (float(value), float(value)) for n in names}


@pytest.fixture
def secret_trainer(tcp_store) -> Iterator[transport.Transport]:
    with transport.Transport(
        "trainer", store=tcp_store, timeout=30, secret=SECRET, heartbeat_interval=0.25
    ) as t:
        yield t


def _publish(pub, tensors, version, timeout=20.0):
    for t in tensors.values():
        t.fill_(version)
    return pub.publish(version, timeout=timeout).wait(timeout + 10)


def _served(sub, spec, version) -> None:
    assert sub.call("wait_for_version", version, 20) == version
    assert sub.call("apply") == version
    assert sub.call("live") == everywhere(spec, version)


def test_with_a_secret_a_killed_and_a_frozen_subscriber_recover(tcp_store, secret_trainer):
    spec = spec_of(2, 2 * MiB)  # 16 MiB
    kw = {"secret": SECRET, "heartbeat_interval": 0.25}
    steady = SubscriberProcess("gen-steady", tcp_store.url, spec, **kw)
    victim = SubscriberProcess("gen-victim", tcp_store.url, spec, **kw)
    frozen = SubscriberProcess("gen-frozen", tcp_store.url, spec, **kw)
    subs = [steady, victim, frozen]
    tensors = make_tensors(spec)
    try:
        with transport.WeightPublisher(secret_trainer, tensors) as pub:
            r = _publish(pub, tensors, 1)
            assert set(r.done) == {"gen-steady", "gen-victim", "gen-frozen"}, r.reasons
            # killed, then restarted under its name: lost once, then served
            victim.kill()
            r = _publish(pub, tensors, 2)
            assert r.status["gen-victim"] in ("lost", "excluded"), r.reasons
            victim = SubscriberProcess("gen-victim", tcp_store.url, spec, **kw)
            subs[1] = victim
            r = _publish(pub, tensors, 3)
            assert set(r.done) == {"gen-steady", "gen-victim", "gen-frozen"}, r.reasons
            # frozen through a publish (excluded), then resumed: served again
            frozen.signal(signal.SIGSTOP)
            try:
                r = _publish(pub, tensors, 4, timeout=4.0)
                assert r.status["gen-frozen"] == "excluded", r.reasons
            finally:
                frozen.signal(signal.SIGCONT)
            wait_until(
                lambda: not {i.name: i for i in secret_trainer.peers()}["gen-frozen"].suspect,
                30,
                "gen-frozen beating again",
            )
            for version in (5, 6):
                publish_served(pub, tensors, version, subs)
        assert secret_trainer.refused_notifications == 0
    finally:
        for sub in subs:
            sub.stop()


def test_with_a_secret_a_publisher_killed_mid_publish_and_restarted_is_heard(tcp_store):
    spec = spec_of(2, 4 * MiB)  # 32 MiB
    kw = {"secret": SECRET}
    subs = [SubscriberProcess(f"gen-{i}", tcp_store.url, spec, **kw) for i in range(2)]
    first = PublisherProcess("trainer", tcp_store.url, spec, **kw)
    try:
        status, reasons = first.call("publish", 1, 1.0, 30.0, 60.0)
        assert status == {"gen-0": "done", "gen-1": "done"}, reasons
        first.call("hold_notified_parts")  # version 2's data goes, its notification never does
        first.call("publish_nowait", 2, 2.0, 30.0)
        for sub in subs:
            sub.call("wait_message", "begin", 2, 10)
        first.kill()
        for sub in subs:
            assert sub.call("state")["version"] == 1
            assert sub.call("apply") == 1
            assert sub.call("live") == everywhere(spec, 1)
        second = PublisherProcess("trainer", tcp_store.url, spec, **kw)
        try:
            for version in (3, 4):
                status, reasons = second.call("publish", version, float(version), 30.0, 60.0)
                assert status == {"gen-0": "done", "gen-1": "done"}, reasons
            for sub in subs:
                _served(sub, spec, 4)
        finally:
            second.stop()
    finally:
        first.stop()
        for sub in subs:
            sub.stop()
