"""apply()'s copy plan: byte runs merged where tensors are adjacent in both memories, never over
memory between them that belongs to no synced tensor."""

from __future__ import annotations

import pytest
import torch

from helpers.loopback_net import pattern
from transport.weights import flat_like
from transport.weights.layouts.flat import copy_runs

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def copier(request, monkeypatch):
    """Every test with the compiled copies and without them (a machine with no C compiler)."""
    if request.param == "torch":
        monkeypatch.setattr("transport.weights.layouts.flat.native", lambda: None)
    return request.param


def named(n: int) -> dict[str, torch.Tensor]:
    dtypes = (torch.float32, torch.float32, torch.bfloat16, torch.float64)
    return {f"w{i}": pattern(3 * (i % 5 + 1), i, dtypes[i % 4]).view(3, -1) for i in range(n)}


def test_two_flat_layouts_of_one_model_copy_in_few_runs():
    src = flat_like(named(1000))
    for t, x in zip(src.values(), named(1000).values(), strict=True):
        t.copy_(x)
    dst = flat_like(src)
    for t in dst.values():
        t.zero_()
    runs = copy_runs(dst, src)
    assert runs.count < 1000 // 2  # dtype alignment gaps split runs; tensors alike merge
    runs.run()
    for k in src:
        assert torch.equal(dst[k], src[k]), k


def test_memory_between_synced_tensors_is_never_written():
    buf = torch.zeros(300)
    dst = {"a": buf[0:100], "b": buf[200:300]}  # buf[100:200] is someone else's
    src = flat_like(dst)
    src["a"].copy_(pattern(100, 1, torch.float32))
    src["b"].copy_(pattern(100, 2, torch.float32))
    runs = copy_runs(dst, src)
    assert runs.count == 2
    runs.run()
    assert torch.equal(buf[0:100], src["a"]) and torch.equal(buf[200:300], src["b"])
    assert int(buf[100:200].count_nonzero()) == 0


def test_separately_allocated_tensors_copy_one_by_one():
    dst = {k: torch.zeros_like(v) for k, v in named(50).items()}
    src = named(50)
    runs = copy_runs(dst, src)
    assert runs.count == 50
    runs.run()
    for k in src:
        assert torch.equal(dst[k], src[k])


def test_a_live_tensor_that_is_not_contiguous_takes_its_elements_in_order():
    dst = {"t": torch.zeros(5, 3).t(), **{k: torch.zeros_like(v) for k, v in named(20).items()}}
    src = flat_like({"t": torch.empty(3, 5), **named(20)})
    src["t"].copy_(pattern(15, 9, torch.float32).view(3, 5))
    for k, v in named(20).items():
        src[k].copy_(v)
    copy_runs(dst, src).run()
    for k in src:
        assert torch.equal(dst[k], src[k]), k
