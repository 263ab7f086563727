"""Garbage in the store costs a warning, never the namespace: a member name that is not a peer
name is skipped by ``peers()``, and a record under a live peer's name that its owner did not
write (garbage, or a forged record that hides its regions) is replaced by the owner's own at its
next heartbeat, so writers find its regions again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import transport
from helpers.loopback_net import pattern
from helpers.polling import wait_until
from transport.peers import directory as peers
from transport.wire import decode_peer_record, encode_peer_record

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _record_key(t) -> str:
    return f"transport/{t.namespace}/peers/{t.name}"


def _valid_with(store, key: str, region: str) -> bool:
    raw = store.try_get(key)
    try:
        return raw is not None and region in decode_peer_record(raw).region_map()
    except Exception:  # noqa: BLE001 - garbage until the owner repairs it
        return False


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("damage", ["garbage", "forged-without-regions", "deleted"])
def test_an_owner_repairs_a_record_it_did_not_write(loopback_net, monkeypatch, damage, large):
    """``large``: as a record of megabytes, which its owner reads back whole only at every
    FULL_CHECK_EVERY-th heartbeat (and checks to exist at the others)."""
    if large:
        monkeypatch.setattr(peers, "SMALL_RECORD", 0)
    dst = torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst}, heartbeat_interval=0.05)
    w = loopback_net.make("w")
    store, key = loopback_net.store, _record_key(r)
    if damage == "garbage":
        store.set(key, b"\x93not a record")
    elif damage == "deleted":
        store.delete(key)
    else:
        rec = decode_peer_record(store.try_get(key))
        store.set(key, encode_peer_record(dataclasses.replace(rec, regions=())))
    wait_until(lambda: _valid_with(store, key, "dst"), 10, "the owner writing its record back")
    src = pattern(4096, 3)
    w.put(src, r.name, "dst").wait(5)
    assert torch.equal(dst, src)


def test_a_member_that_is_not_a_peer_name_is_skipped(loopback_net, caplog):
    r = loopback_net.receiver("r", {"dst": torch.zeros(64, dtype=torch.uint8)})
    w = loopback_net.make("w")
    store = loopback_net.store
    idx = store.add(f"transport/{w.namespace}/members/count", 1)
    store.set(f"transport/{w.namespace}/members/{idx}", b"bad\x00name")
    assert {p.name for p in w.peers()} == {r.name, w.name}
    assert "is not a peer name" in caplog.text
    w.put(pattern(64, 1), r.name, "dst").wait(5)


def test_garbage_in_a_weight_group_never_stops_its_publishes(loopback_net, caplog):
    """A malformed group entry and a member name that is not a peer name are skipped, with a
    warning naming the key; the real subscribers get every version, and a subscriber whose own
    entry was overwritten writes it back."""

    gen = loopback_net.make("gen", heartbeat_interval=0.05)
    live = {"w": torch.zeros(4096, dtype=torch.uint8)}
    sub = transport.WeightSubscriber(gen, live, group="policy")
    trainer = loopback_net.make("trainer")
    weights = {"w": pattern(4096, 1)}
    pub = transport.WeightPublisher(trainer, weights, group="policy")
    store, prefix = loopback_net.store, f"transport/{gen.namespace}/groups/policy/"
    # a member with a malformed entry, one whose name is not a name, and our own entry garbled
    for name in ("mallory", "bad\x00name"):  # the second cannot even have an entry (a key)
        idx = store.add(prefix + "members/count", 1)
        store.set(prefix + f"members/{idx}", name.encode())
    store.set(prefix + "sub/mallory", b"\xc1garbage")
    store.add(prefix + "epoch", 1)
    assert pub.publish(1, timeout=10).wait(10).done == [gen.name]
    sub.wait_for_version(1, timeout=10)
    assert sub.apply() == 1 and torch.equal(live["w"], pattern(4096, 1))
    assert "mallory" in caplog.text and "is not a peer name" in caplog.text
    own = prefix + f"sub/{gen.name}"
    store.set(own, b"\xc1garbage")
    store.add(prefix + "epoch", 1)
    wait_until(lambda: store.try_get(own) != b"\xc1garbage", 10, "the entry written back")
    weights["w"].copy_(pattern(4096, 2))
    assert pub.publish(2, timeout=10).wait(10).done == [gen.name]
    sub.wait_for_version(2, timeout=10)
    assert sub.apply() == 2 and torch.equal(live["w"], pattern(4096, 2))
    pub.close()
    sub.close()


def test_an_older_record_put_back_never_brings_a_withdrawn_region_back(loopback_net, caplog):
    """A store writer copies a peer's record while it exposes two regions and puts it back after
    the peer withdrew one (whose memory is the caller's again). A writer that knows the newer
    record never goes back to it: a put into the withdrawn region is refused, and that memory
    is untouched. (With a secret the copy is a validly sealed record of the same incarnation.)"""
    keep = torch.zeros(4096, dtype=torch.uint8)
    gone = torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"keep": keep, "gone": gone}, heartbeat_interval=3600)
    w = loopback_net.make("w")
    w.put(pattern(4096, 1), r.name, "gone").wait(5)  # w knows the record with both
    store, key = loopback_net.store, _record_key(r)
    old = store.try_get(key)
    assert r.unexpose("gone", timeout=10) == []
    gone.zero_()  # the caller's memory again
    with pytest.raises(transport.RegionError):
        w.put(pattern(4096, 2), r.name, "gone").wait(5)
    store.set(key, old)  # the replay
    with pytest.raises(transport.RegionError):
        w.put(pattern(4096, 3), r.name, "gone").wait(5)
    assert "ignoring an older record" in caplog.text
    assert not gone.any()
    w.put(pattern(4096, 4), r.name, "keep").wait(5)
    assert torch.equal(keep, pattern(4096, 4))
