"""How a transfer's descriptor rows are cut into parts (plan.split_descs) and into shares over
lanes (lanes.cut): every byte once, in order, local and remote rows paired, sizes as promised."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.transfers.lanes import cut
from transport.transfers.plan import split_descs

pytestmark = pytest.mark.unit


def rows(sizes: list[int], base: int) -> np.ndarray:
    out, addr = [], base
    for n in sizes:
        out.append((addr, n, 0))
        addr += n + 4096  # gaps: rows are separate regions
    return np.array(out, dtype=np.uint64)


def bytes_of(desc: np.ndarray) -> list[tuple[int, int]]:
    """(address, length) runs of ``desc``, adjacent runs merged."""
    out: list[list[int]] = []
    for a, n, _ in desc.tolist():
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += n
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


sizes_st = st.lists(st.integers(1, 5000), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(sizes_st, st.integers(1, 3000), st.integers(0, 30000), st.integers(0, 30000))
def test_split_descs_covers_every_byte_once(
    sizes: list[int], chunk: int, head: int, tail: int
) -> None:
    local, remote = rows(sizes, 1 << 20), rows(sizes, 1 << 30)
    total = sum(sizes)
    lo, re, bounds = split_descs(local, remote, chunk, head, tail)
    assert bytes_of(lo) == bytes_of(local) and bytes_of(re) == bytes_of(remote)
    assert (lo[:, 1] == re[:, 1]).all() and (lo[:, 1] > 0).all()
    # local and remote rows stay paired: the same offset into the same row on both sides
    assert ((lo[:, 0] - (1 << 20)) == (re[:, 0] - (1 << 30))).all()
    assert bounds[0][0] == 0 and bounds[-1][1] == len(lo)
    assert all(a < b for a, b in bounds) and all(
        b == c for (_, b), (c, _) in zip(bounds, bounds[1:], strict=False)
    )
    part_bytes = [int(lo[a:b, 1].sum()) for a, b in bounds]
    if (head or tail) and head + tail < total:
        middle = part_bytes[(1 if head else 0) : len(part_bytes) - (1 if tail else 0)]
        assert (part_bytes[0] == head) if head else True
        assert (part_bytes[-1] == tail) if tail else True
        assert middle and all(n <= chunk for n in middle)
    else:
        assert all(n <= chunk for n in part_bytes)


@settings(max_examples=300, deadline=None)
@given(sizes_st, st.integers(1, 6))
def test_cut_gives_equal_shares_in_order(sizes: list[int], n: int) -> None:
    local, remote = rows(sizes, 1 << 20), rows(sizes, 1 << 30)
    shares = cut(local, remote, n)
    total = sum(sizes)
    assert 1 <= len(shares) <= n
    joined_lo = np.concatenate([lo for lo, _ in shares])
    joined_re = np.concatenate([re for _, re in shares])
    assert bytes_of(joined_lo) == bytes_of(local) and bytes_of(joined_re) == bytes_of(remote)
    target = -(-total // n)
    assert all(int(lo[:, 1].sum()) <= target for lo, _ in shares[:-1])
