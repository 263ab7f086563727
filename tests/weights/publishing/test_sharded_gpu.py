"""A sharded trainer on the GPU: two ranks (separate Transports, real NIXL) hold CUDA shards and
write them into a generator's CUDA tensors in bf16 and in fp8 with block scales, converted on the
device through the ranks' pools; bytes checked against a reference of the full weights."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.shard_peer import shard_of
from transport.weights import (
    DestTensor,
    ShardedPublisher,
    SourceLayout,
    fp8,
    full_copy,
    tensors_for,
)
from transport.weights.layouts.convert import fp8_blockwise

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="this process has no CUDA device"),
    pytest.mark.timeout(120),
]


def test_two_cuda_ranks_into_bf16_and_fp8_cuda_generators(tcp_store):
    shapes = {"q": (512, 256), "o": (256, 512), "n": (256,)}
    full = {n: torch.randn(s, device="cuda") for n, s in shapes.items()}
    src = SourceLayout.split(
        2, {n: (s, torch.float32) for n, s in shapes.items()}, {"o": 1, "n": None}
    )
    bf16 = {n: DestTensor(d.shape, torch.bfloat16, d.pieces) for n, d in full_copy(src).items()}
    q8 = fp8(full_copy(src), ["q", "o"], block=(128, 128))
    opened = []
    try:
        ranks = []
        for r in range(2):
            t = transport.Transport(f"gpu-rank{r}", store=tcp_store, timeout=30)
            opened.append(t)
            ranks.append(ShardedPublisher(t, shard_of(src, full, r), src, r, group="g"))
        subs = []
        for name, lay in (("gpu-bf16", bf16), ("gpu-fp8", q8)):
            t = transport.Transport(name, store=tcp_store, timeout=30)
            opened.append(t)
            live = tensors_for(lay, "cuda")
            subs.append((transport.WeightSubscriber(t, live, group="g", layout=lay), live))
        handles = [p.publish(1, timeout=30) for p in ranks]
        for h in handles:
            assert len(h.wait(60).done) == 2, h.result
        (sb, lb), (s8, l8) = subs
        sb.wait_for_version(1, 30)
        s8.wait_for_version(1, 30)
        sb.apply()
        s8.apply()
        torch.cuda.synchronize()
        for n in shapes:
            assert torch.equal(lb[n], full[n].to(torch.bfloat16)), n
        for n in ("q", "o"):
            q, s = fp8_blockwise(full[n], (128, 128))
            assert torch.equal(l8[n].view(torch.uint8), q.view(torch.uint8)), n
            assert torch.equal(l8[n + "_scale"], s), n
        for p in ranks:
            p.close()
        for sub, _ in subs:
            sub.close()
    finally:
        for t in opened:
            t.close()
