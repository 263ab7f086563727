"""Registration by allocation on a real GPU: separately allocated CUDA tensors in one segment of
the caching allocator are one NIXL registration, and the bytes a peer writes into each land
there and nowhere else."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="this process has no CUDA device (torch.cuda.is_available() is False); registration "
        "by allocation segment runs on a GPU only",
    ),
]


def test_separate_cuda_tensors_in_one_segment_are_one_registration(tcp_store, writer):
    torch.cuda.synchronize()
    live = {f"w{i}": torch.zeros(1024, device="cuda") for i in range(64)}  # 256 KiB: one segment
    with transport.Transport("gen-seg", store=tcp_store, timeout=30) as g:
        g.expose_all(live)
        segments = {
            (s["address"], s["total_size"])
            for s in torch.cuda.memory_snapshot()
            for t in live.values()
            if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]
        }
        assert len(internals.local_memory(g)) == len(segments) < len(live)
        writer.wait_for_peer("gen-seg", 30)
        for i in range(len(live)):
            writer.put(torch.full((1024,), float(i + 1), device="cuda"), "gen-seg", f"w{i}").wait(
                30
            )
        for i, t in enumerate(live.values()):
            assert torch.equal(t, torch.full((1024,), float(i + 1), device="cuda")), i
