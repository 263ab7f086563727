"""The compiled helper's many host copies in one call: every byte where it belongs, nothing
around it touched, the same with the copies split over threads."""

from __future__ import annotations

import random

import pytest
import torch

from transport.host_copy import THREAD_BYTES, HostCopies, native

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_compiled_helper_was_built():
    assert native() is not None, (
        "transport._host_copy was not built: install a C compiler (Debian: gcc) and reinstall "
        "the package (pip install -e .); without it publishers copy small tensors 1.5-2x slower"
    )


@pytest.mark.parametrize("total", [1 << 20, 3 * THREAD_BYTES])  # one thread; several
def test_every_byte_lands_where_it_belongs_and_nothing_around_it(total):
    rng = random.Random(total)
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.choice([0, 1, 3, 64, 2688, 40_000, 1 << 20]))
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    # the destinations scattered through one buffer, with guard bytes around each
    out = torch.full((sum(sizes) + 7 * len(sizes),), 0xEE, dtype=torch.uint8)
    dsts, at = [], 0
    for n in sizes:
        at += 7
        dsts.append(out[at : at + n])
        at += n
    order = list(range(len(sizes)))
    rng.shuffle(order)  # in no particular order of addresses
    copies = HostCopies.between([dsts[i] for i in order], [srcs[i] for i in order])
    assert copies.nbytes == sum(sizes)
    copies.run()
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
    guards = torch.ones_like(out, dtype=torch.bool)
    for d in dsts:
        start = d.data_ptr() - out.data_ptr()
        guards[start : start + d.numel()] = False
    assert bool((out[guards] == 0xEE).all())
    for s in srcs:  # a second run copies the sources' current bytes
        s.random_(0, 256)
    copies.run()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_tensors_it_cannot_copy_are_refused_with_the_rule():
    a, b = torch.zeros(8), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="contiguous"):
        HostCopies.between([a], [b.t()])
    with pytest.raises(ValueError, match="32 bytes into 16"):
        HostCopies.between([torch.zeros(4)], [a])
    with pytest.raises(ValueError, match="destinations for"):
        HostCopies.between([a], [])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="host tensors"):
            HostCopies.between([a], [a.cuda()])
