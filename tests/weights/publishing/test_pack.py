"""A publisher's small, separately allocated tensors copied into one buffer at each publish: every
byte where a subscriber's flat layout has it, written as a handful of descriptors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import internals
from helpers.loopback_net import pattern
from transport.weights import flat_like
from transport.weights.publishing.pack import PACK_MIN_TENSORS, PACK_TENSOR_BYTES, Pack, packable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def copier(request, monkeypatch):
    """Every test with the compiled copies and without them (a machine with no C compiler)."""
    if request.param == "numpy":
        monkeypatch.setattr("transport.weights.publishing.pack.native", lambda: None)
    return request.param


DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.int8,
    torch.bool,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int16,
)


def loose(n: int) -> dict[str, torch.Tensor]:
    """``n`` separately allocated tensors of mixed dtypes and shapes (a scalar among them), each
    holding a pattern of its own."""
    out = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        shape = () if i == 7 else (3, 1 + i % 11)
        t = torch.empty(shape, dtype=dtype)
        set_pattern(t, i)
        if i % 13 == 0 and dtype.is_floating_point:  # a model's parameter: it requires grad
            t = torch.nn.Parameter(t)
        out[f"layers.{i // 4}.t{i % 4}"] = t
    return out


def set_pattern(t: torch.Tensor, seed: int) -> None:
    with torch.no_grad():  # as an optimizer steps
        t.view(-1).view(torch.uint8).copy_(pattern(t.nbytes, seed, torch.uint8))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_small_loose_tensors_are_packed_and_every_fill_copies_their_current_bytes():
    named = loose(300)
    pack = Pack(named)
    assert pack.names == tuple(named)  # all small, each a storage of its own
    pack.fill()
    for n, t in named.items():
        src = pack.sources[n]
        assert src.shape == t.shape and src.dtype == t.dtype
        assert src.data_ptr() != t.data_ptr() and same_bytes(src, t), n
    for i, t in enumerate(named.values()):  # the optimizer step: in place
        set_pattern(t, 1000 + i)
    assert not all(same_bytes(pack.sources[n], t) for n, t in named.items())
    pack.fill()
    assert all(same_bytes(pack.sources[n], t) for n, t in named.items())


def test_large_tensors_and_tensors_sharing_a_storage_are_left_as_they_are():
    big = torch.zeros(PACK_TENSOR_BYTES // 4 + 1)
    flat = flat_like({f"f{i}": torch.zeros(8) for i in range(100)})  # they merge anyway
    named = {"big": big, **flat, **{f"s{i}": torch.zeros(8) for i in range(PACK_MIN_TENSORS)}}
    assert packable(named) == [f"s{i}" for i in range(PACK_MIN_TENSORS)]
    pack = Pack(named)
    assert pack.sources["big"] is big and all(pack.sources[n] is t for n, t in flat.items())
    transposed = {f"t{i}": torch.zeros(4, 2).t() for i in range(PACK_MIN_TENSORS)}
    assert packable(transposed) == []  # the batch refuses them, naming the rule
    few = {f"s{i}": torch.zeros(8) for i in range(PACK_MIN_TENSORS - 1)}
    assert packable(few) == [] and Pack(few).sources == few


def test_tensors_with_foreign_bytes_between_them_are_packed_without_those_bytes():
    """Experts allocated one after another (here: storages of their own placed 40 bytes apart,
    with bytes between them that belong to nobody): the pack holds exactly the tensors' bytes,
    and the bytes between them are never copied."""
    width, step, experts = 24, 40, 64
    arena = np.full(experts * 3 * step, 0xEE, dtype=np.uint8)
    named = {}
    for e in range(experts):
        for r, role in enumerate(("gate", "up", "down")):
            at = (e * 3 + r) * step
            named[f"experts.{e}.{role}"] = torch.frombuffer(
                arena[at : at + width], dtype=torch.float32
            )
    for i, t in enumerate(named.values()):
        set_pattern(t, i)
    pack = Pack(named)
    assert len(pack.names) == experts * 3
    pack.fill()
    assert all(same_bytes(pack.sources[n], t) for n, t in named.items())
    whole = torch.empty(0, dtype=torch.uint8).set_(pack.sources["experts.0.gate"].untyped_storage())
    # exactly the tensors' bytes, one after another: nothing of the bytes between them came along
    assert torch.equal(
        whole[: pack.nbytes], torch.cat([t.view(torch.uint8) for t in named.values()])
    )
    for i, t in enumerate(named.values()):
        set_pattern(t, 5000 + i)
    pack.fill()
    assert all(same_bytes(pack.sources[n], t) for n, t in named.items())


def test_a_batch_of_packed_tensors_into_a_flat_layout_is_a_few_descriptors(loopback_net):
    named = loose(1000)
    r, dst = loopback_net.flat_receiver("r", named)
    w = loopback_net.make("w")
    pack = Pack(named)
    pack.fill()
    w.put(pack.sources, r.name).wait(10)
    assert all(same_bytes(dst[n], t) for n, t in named.items())
    (plan,) = internals.plans(w)
    # the pack is laid out as flat_like lays out the destination: adjacent at both ends except
    # where a dtype's alignment leaves a gap between two tensors (no byte outside one is written)
    ends = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in dst.values()]
    gaps = sum(1 for a, b in zip(ends, ends[1:], strict=False) if a[1] != b[0])
    assert 0 < gaps < 1000 and len(plan.rows.local) == gaps + 1
