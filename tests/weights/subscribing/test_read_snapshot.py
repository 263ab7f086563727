"""WeightSubscriber.read(): a complete version held where it landed, for an engine whose own
loader takes the tensors (vLLM's). A subscriber given meta tensors (shapes only) has staging
slots and no live tensors. The publisher never writes a held slot: a version published while a
read holds the newest one lands in the other slot, and a third waits for the read to end. Only
the newest complete version can be read: every other slot is the publisher's to write."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import pattern

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

N = 1 << 16


def _pair(net, spec_only=True):
    gen = net.make("gen")
    if spec_only:
        named = {
            "a": torch.empty(N, dtype=torch.uint8, device="meta"),
            "b": torch.empty(N // 4, dtype=torch.float32, device="meta"),
        }
        sub = transport.WeightSubscriber(gen, named, staging_device="cpu")
    else:
        named = {"a": torch.zeros(N, dtype=torch.uint8), "b": torch.zeros(N // 4)}
        sub = transport.WeightSubscriber(gen, named)
    trainer = net.make("trainer")
    weights = {"a": pattern(N, 1), "b": torch.zeros(N // 4)}
    pub = transport.WeightPublisher(trainer, weights)
    return sub, pub, weights


def _fill(weights, version):
    weights["a"].copy_(pattern(N, version))
    weights["b"].fill_(float(version))


def _is(snapshot, version):
    return (
        snapshot.version == version
        and torch.equal(snapshot.tensors["a"], pattern(N, version))
        and bool((snapshot.tensors["b"] == float(version)).all())
    )


def test_read_holds_the_version_while_newer_ones_land_elsewhere(loopback_net):
    sub, pub, weights = _pair(loopback_net)
    assert sub.spec_only and sub.staging[0]["a"].device.type == "cpu"
    _fill(weights, 1)
    assert pub.publish(1, timeout=10).wait(10).done
    with sub.read(timeout=10) as snap:
        assert _is(snap, 1)
        _fill(weights, 2)
        assert pub.publish(2, timeout=10).wait(10).done  # into the other slot
        sub.wait_for_version(2, timeout=10)
        assert _is(snap, 1), "a held version changed under its reader"
        _fill(weights, 3)
        third = pub.publish(3, timeout=30)  # both slots busy: waits for the read to end
        assert not third.done() and _is(snap, 1)
    assert third.wait(30).done
    with sub.read(3, timeout=10) as snap:
        assert _is(snap, 3)
    assert sub.applied_version == 3
    with pytest.raises(transport.VersionGoneError, match="version 1 .* no longer held"):
        with sub.read(1, timeout=1):
            pass
    # version 2's bytes may still be in a slot, but that slot was handed back to the publisher
    with pytest.raises(transport.VersionGoneError, match="version 2 .* replaced it"):
        with sub.read(2, timeout=1):
            pass


def test_read_of_a_version_that_never_comes_times_out_and_names_the_newest(loopback_net):
    sub, pub, weights = _pair(loopback_net)
    _fill(weights, 1)
    assert pub.publish(1, timeout=10).wait(10).done
    with pytest.raises(transport.TransferTimeout, match=r"version 5 .* \(newest complete: 1\)"):
        with sub.read(5, timeout=0.2):
            pass
    with sub.read(timeout=1) as snap:  # the failed read held nothing
        assert _is(snap, 1)


def test_one_read_at_a_time_and_no_apply_without_live_tensors(loopback_net):
    sub, pub, weights = _pair(loopback_net)
    _fill(weights, 1)
    assert pub.publish(1, timeout=10).wait(10).done
    with pytest.raises(ValueError, match="no live tensors"):
        sub.apply()
    with sub.read(timeout=10), pytest.raises(RuntimeError, match="one at a time"):
        with sub.read(timeout=10):
            pass


def test_meta_tensors_need_staging_and_a_device(loopback_net):
    gen = loopback_net.make("gen")
    meta = {"a": torch.empty(8, device="meta")}
    with pytest.raises(ValueError, match="staging_device"):
        transport.WeightSubscriber(gen, meta)
    with pytest.raises(ValueError, match="staging_device"):
        transport.WeightSubscriber(gen, meta, mode="inplace", staging_device="cpu")
    with pytest.raises(ValueError, match="mixes"):
        transport.WeightSubscriber(gen, {**meta, "b": torch.zeros(8)}, staging_device="cpu")


def test_read_works_beside_live_tensors_too(loopback_net):
    sub, pub, weights = _pair(loopback_net, spec_only=False)
    _fill(weights, 1)
    assert pub.publish(1, timeout=10).wait(10).done
    with sub.read(1, timeout=10) as snap:
        assert _is(snap, 1)
    assert sub.apply() == 1 and torch.equal(sub.live["a"], pattern(N, 1))


def test_one_slot_keeps_a_version_until_it_is_read_then_hands_it_back(loopback_net):
    """Half the memory: the next version waits until the one in the slot was read (applied);
    after that the slot is the publisher's and the version it held is no longer readable."""
    gen, trainer = loopback_net.make("gen"), loopback_net.make("trainer")
    named = {
        "a": torch.empty(N, dtype=torch.uint8, device="meta"),
        "b": torch.empty(N // 4, dtype=torch.float32, device="meta"),
    }
    sub = transport.WeightSubscriber(gen, named, staging_device="cpu", slots=1)
    assert len(sub.staging) == 1 and not sub.relay
    weights = {"a": pattern(N, 1), "b": torch.zeros(N // 4)}
    pub = transport.WeightPublisher(trainer, weights)
    _fill(weights, 1)
    assert pub.publish(1, timeout=10).wait(10).done
    _fill(weights, 2)
    second = pub.publish(2, timeout=30)  # the only slot holds version 1, not yet read
    assert not second.done()
    with sub.read(1, timeout=10) as snap:
        assert _is(snap, 1)
    with pytest.raises(
        transport.VersionGoneError, match="version 1 was applied and its slot reused"
    ):
        with sub.read(1, timeout=1):
            pass
    assert second.wait(30).done
    with sub.read(2, timeout=10) as snap:
        assert _is(snap, 2)
    for version in (3, 4):  # each read hands the slot back for the next
        _fill(weights, version)
        assert pub.publish(version, timeout=10).wait(10).done
        with sub.read(version, timeout=10) as snap:
            assert _is(snap, version)
    with pytest.raises(ValueError, match="slots is 2 or 1"):
        transport.WeightSubscriber(loopback_net.make("gen-3"), named, staging_device="cpu", slots=3)
    pub.close()
    sub.close()
