"""Transport.batch: named tensors checked once and put again and again, on the loopback backend."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import pattern

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_batch_is_put_again_and_again_with_the_tensors_current_bytes(loopback_net):
    dst = {f"t{i}": torch.zeros(64 + i, dtype=torch.float32) for i in range(300)}
    r = loopback_net.receiver("r", dst)
    w = loopback_net.make("w")
    src = {n: torch.empty_like(t) for n, t in dst.items()}
    batch = transport.Transport.batch(src)
    assert len(batch) == 300
    for step in range(3):
        for i, t in enumerate(src.values()):  # updated in place, as an optimizer does
            t.copy_(pattern(t.numel(), 1000 * step + i, torch.float32))
        w.put(batch, r.name, notify=b"%d" % step).wait(10)
        assert r.wait_notification(10, peer=w.name).payload == b"%d" % step
        for n, t in dst.items():
            assert torch.equal(t, src[n]), (step, n)


def test_a_batch_keeps_what_it_was_made_from():
    a, b = torch.ones(4), torch.zeros(4)
    named = {"x": a}
    batch = transport.Transport.batch(named)
    named["x"] = b  # the dict changes afterwards; the batch does not
    assert batch.items == (("x", a),)


def test_a_bad_batch_is_refused_when_it_is_made_and_when_it_is_used(loopback_net):
    with pytest.raises(ValueError, match="not contiguous"):
        transport.Transport.batch({"x": torch.zeros(4, 4).t()})
    with pytest.raises(TypeError, match="region names"):
        transport.Transport.batch({1: torch.zeros(4)})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="empty"):
        transport.Transport.batch({})
    r = loopback_net.receiver("r", {"x": torch.zeros(4)})
    w = loopback_net.make("w")
    batch = transport.Transport.batch({"x": torch.ones(4)})
    with pytest.raises(ValueError, match="key= cannot be combined"):
        w.put(batch, r.name, "x")


def test_a_batch_of_triples_places_each_tensor_at_its_own_offset(loopback_net):
    """Several writes into one region, each at its offset (the strided rows of a shard)."""
    dst = {"m": torch.zeros(8, 6), "v": torch.zeros(10)}
    r = loopback_net.receiver("r", dst)
    w = loopback_net.make("w")
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1  # columns 3..5 of rows 2..5
    tail = torch.full((4,), 7.0)
    batch = transport.Transport.batch(
        [("m", rows[i], (2 + i) * 6 + 3) for i in range(4)] + [("v", tail, 6)]
    )
    assert len(batch) == 5 and batch.offsets == (15, 21, 27, 33, 6)
    w.put(batch, r.name, notify=b"x").wait(10)
    assert r.wait_notification(10, peer=w.name).payload == b"x"
    want = torch.zeros(8, 6)
    want[2:6, 3:6] = rows
    assert torch.equal(dst["m"], want)
    assert torch.equal(dst["v"], torch.cat([torch.zeros(6), tail]))
    with pytest.raises(RegionErrorType, match="do not fit"):  # checked when planned
        w.put(transport.Transport.batch([("v", tail, 7)]), r.name).wait(10)


RegionErrorType = transport.RegionError


@pytest.mark.parametrize(
    ("entries", "error", "message"),
    [
        ([("m", torch.zeros(2), -1)], ValueError, "non-negative int"),
        ([("m", torch.zeros(2))], TypeError, "region name, tensor, offset"),
        ([], ValueError, "empty"),
        ("m", TypeError, "a dict of name -> tensor or a list"),
    ],
)
def test_a_bad_list_of_triples_is_refused_with_the_rule(entries, error, message):
    with pytest.raises(error, match=message):
        transport.Transport.batch(entries)
