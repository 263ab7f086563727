"""Garbage in a weight group's counters (its epoch, its member count) never stops a subscriber
from joining nor a publish: whoever meets it repairs it, a warning names the key, a repaired
epoch still tells the publisher that the group changed, and a repaired member count keeps every
member. Every element of every tensor of version N holds N (see test_weight_sync)."""

from __future__ import annotations

import logging

import pytest

import transport
from helpers.ws_peer import SubscriberProcess, make_tensors, spec_of

pytestmark = pytest.mark.timeout(180)

SPEC = spec_of(3, 4096)
PREFIX = "transport/default/groups/policy/"


def everywhere(value):
    return {n: (float(value), float(value)) for n in SPEC}


def publish_and_check(pub, tensors, version, subs):
    for t in tensors.values():
        t.fill_(version)
    r = pub.publish(version, timeout=20).wait(30)
    assert r.done == sorted(s.name for s in subs), r.reasons
    for s in subs:
        assert s.call("wait_for_version", version, 10) == version
        assert s.call("apply") == version
        assert s.call("live") == everywhere(version)


@pytest.fixture
def trainer(interprocess_store):
    """A Transport named "trainer" in the test process, on the embedded store or on Redis."""
    with transport.Transport("trainer", store=interprocess_store, timeout=30) as t:
        yield t


def test_garbage_in_the_group_counters_stops_neither_a_join_nor_a_publish(
    trainer, interprocess_store, caplog
):
    store, subs = interprocess_store, []

    def damage(epoch: bytes, count: bytes | None = None) -> None:
        store.set(PREFIX + "epoch", epoch)
        if count is not None:
            store.set(PREFIX + "members/count", count)

    try:
        damage(b"not a number", b"not a number")
        subs.append(SubscriberProcess("gen-a", store.url, SPEC))  # its join repairs both
        damage(b"", b"-5")
        tensors = make_tensors(SPEC)
        with transport.WeightPublisher(trainer, tensors, group="policy") as pub:
            with caplog.at_level(logging.WARNING, "transport"):
                publish_and_check(pub, tensors, 1, subs)  # the publisher repairs both
            assert PREFIX + "epoch" in caplog.text and PREFIX + "members/count" in caplog.text
            # a joiner that repairs the epoch still makes the publisher read the group again
            damage(b"99999999999999999999999", b"99999999999999999999999")
            subs.append(SubscriberProcess("gen-b", store.url, SPEC))
            publish_and_check(pub, tensors, 2, subs)
            damage(b"\xff\x00junk")
            publish_and_check(pub, tensors, 3, subs)
    finally:
        for sub in subs:
            sub.stop()
