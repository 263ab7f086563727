"""Registration by allocation: storages that lie in one allocation (as CUDA's caching allocator
packs parameters into segments) are registered once, as that allocation. The allocator is
stood in for on host memory here: storages made inside one buffer, and an allocation table that
says where that buffer lies."""

from __future__ import annotations

import pytest
import torch

from helpers import internals
from helpers.loopback_net import LoopbackNet, pattern
from transport.memory import local as memory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SIZE = 1 << 20


class Allocation:
    """One host buffer that tensors of separate storages are made in."""

    def __init__(self) -> None:
        self.buf = bytearray(SIZE)
        self.base = torch.frombuffer(self.buf, dtype=torch.uint8, count=1).data_ptr()

    def tensor(self, offset: int, numel: int) -> torch.Tensor:
        return torch.frombuffer(self.buf, dtype=torch.float32, count=numel, offset=offset)


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[Allocation]:
    """Allocations the registration cache is told about (as the CUDA allocator's segments)."""
    made: list[Allocation] = []
    monkeypatch.setattr(
        memory, "allocator_segments", lambda device: sorted((a.base, SIZE) for a in made)
    )
    made.extend([Allocation(), Allocation()])
    return made


def test_storages_in_one_allocation_are_one_registration(
    loopback_net: LoopbackNet, allocations: list[Allocation]
):
    a, b = allocations
    live = {f"w{i}": a.tensor(i * 8192, 1024) for i in range(10)}
    assert len({t.untyped_storage().data_ptr() for t in live.values()}) == 10  # 10 storages
    g = loopback_net.make("gen")
    g.expose_all(live)
    assert len(internals.local_memory(g)) == 1
    assert next(p for p in g.peers() if p.name == g.name).registrations == 1
    # a writer whose sources lie in one allocation registers it once too
    w = loopback_net.make("trainer")
    srcs = [b.tensor(i * 8192, 1024) for i in range(10)]
    for i, src in enumerate(srcs):
        src.copy_(pattern(1024, i, torch.float32))
        w.put(src, g.name, f"w{i}").wait(10)
    assert len(internals.local_memory(w)) == 1
    for i in range(10):
        assert torch.equal(live[f"w{i}"], srcs[i])
    # the bytes between the tensors were not touched
    between = torch.frombuffer(a.buf, dtype=torch.uint8)[4096:8192]
    assert int(between.count_nonzero()) == 0


def test_the_allocation_stays_registered_while_any_exposed_tensor_lies_in_it(
    loopback_net: LoopbackNet, allocations: list[Allocation]
):
    a, _ = allocations
    g = loopback_net.make("gen")
    g.expose_all({"x": a.tensor(0, 16), "y": a.tensor(4096, 16)})
    g.unexpose("x", timeout=5)
    assert len(internals.local_memory(g)) == 1
    g.unexpose("y", timeout=5)
    assert len(internals.local_memory(g)) == 0


def test_a_storage_outside_every_allocation_is_registered_alone(
    loopback_net: LoopbackNet, allocations: list[Allocation]
):
    a, _ = allocations
    g = loopback_net.make("gen")
    g.expose_all({"in": a.tensor(0, 16), "out": torch.zeros(16)})
    assert len(internals.local_memory(g)) == 2
