"""Descriptors merged where tensors are adjacent at both ends, and nowhere else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import internals
from helpers.loopback_net import pattern
from transport.transfers.plan import coalesce
from transport.weights import flat_like

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def rows(*r: tuple[int, int, int]) -> np.ndarray:
    return np.array(r, dtype=np.uint64)


def test_adjacent_rows_merge_and_others_stay():
    local = rows((1000, 10, 0), (1010, 20, 0), (1030, 5, 0), (2000, 8, 0))
    remote = rows((5000, 10, 0), (5010, 20, 0), (6000, 5, 0), (6005, 8, 0))
    lo, re = coalesce(local, remote, [1000, 2000], [5000])
    # rows 0+1 adjacent at both ends; row 2 is not adjacent remotely; row 3 not locally
    assert lo.tolist() == [[1000, 30, 0], [1030, 5, 0], [2000, 8, 0]]
    assert re.tolist() == [[5000, 30, 0], [6000, 5, 0], [6005, 8, 0]]


def test_rows_of_two_registrations_or_devices_never_merge():
    local = rows((1000, 10, 0), (1010, 10, 0), (1020, 10, 1))
    remote = rows((5000, 10, 0), (5010, 10, 0), (5020, 10, 1))
    # the local memory at 1010 is another registration, though adjacent to the first
    lo, _ = coalesce(local, remote, [1000, 1010, 1020], [5000, 5020])
    assert len(lo) == 3
    lo, _ = coalesce(local, remote, [1000], [5000])  # device ids differ for the last row
    assert lo.tolist() == [[1000, 20, 0], [1020, 10, 1]]
    lo, _ = coalesce(local, remote, [1000], [])  # registrations unknown: nothing merged
    assert len(lo) == 3


def test_a_batch_between_two_flat_layouts_is_one_descriptor_and_every_byte_lands(loopback_net):
    shapes = [(64,), (3, 7), (5,), (128, 2), (1,)] * 200  # 1,000 tensors
    named = {f"t{i}": torch.zeros(s, dtype=torch.float32) for i, s in enumerate(shapes)}
    r, dst = loopback_net.flat_receiver("r", named)
    w = loopback_net.make("w")
    src = flat_like(named)
    for i, t in enumerate(src.values()):
        t.copy_(pattern(t.numel(), i, torch.float32).view(t.shape))
    w.put(src, r.name).wait(10)
    for n, t in dst.items():
        assert torch.equal(t, src[n]), n
    (plan,) = internals.plans(w)
    assert len(plan.rows.local) == 1  # 1,000 tensors, one descriptor
    # separately allocated sources: as many rows as tensors that are not adjacent
    loose = {n: t.clone() for n, t in src.items()}
    w.put(loose, r.name).wait(10)
    assert all(torch.equal(t, loose[n]) for n, t in dst.items())
