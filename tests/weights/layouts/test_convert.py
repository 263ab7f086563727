"""Conversions in flight (transport.weights.layouts.convert) against a reference written plainly, block
by block with Python loops: the fp8 bytes and the scales must be equal, not close."""

from __future__ import annotations

import pytest
import torch

from transport.weights.layouts.convert import (
    FP8,
    FP8_MAX,
    convert,
    fp8_blockwise,
    fp8_dequantize,
    fp8_per_tensor,
)

pytestmark = pytest.mark.unit


def _reference_blockwise(x, br, bc):
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=FP8)
    nr, nc = -(-rows // br), -(-cols // bc)
    scale = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            blk = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            amax = blk.abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)  # e4m3fn: 448 is its max
            scale[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / s).to(FP8)
    return q, scale


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (5, 7)])
def test_block_scales_equal_the_plain_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(dtype)
    x[: min(128, shape[0]), : min(128, shape[1])] = 0  # a block of zeros: scale 1
    q, scale = fp8_blockwise(x)
    rq, rscale = _reference_blockwise(x, 128, 128)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert torch.equal(scale, rscale)
    assert torch.equal(_bits(q), _bits(rq))
    assert scale[0, 0] == 1.0
    # and it means what it says: within half an e4m3 step of the source (3 mantissa bits: 1/16
    # relative; below the smallest normal, half the subnormal step 2^-9, times the block's scale)
    back = fp8_dequantize(q, scale, (128, 128))
    full = fp8_dequantize(torch.ones(shape, dtype=FP8), scale, (128, 128))
    bound = torch.maximum(x.float().abs() / 16, full * 2.0**-10) * 1.0001
    assert back.shape == x.shape and bool(((back - x.float()).abs() <= bound).all())


def test_per_tensor_scale_and_a_tensor_of_zeros():
    x = torch.randn(64, 64) * 3
    q, scale = fp8_per_tensor(x)
    assert scale.shape == (1,) and torch.equal(scale, (x.abs().max() / FP8_MAX).reshape(1))
    assert torch.equal(_bits(q), _bits((x / scale).to(FP8)))
    assert float(q.float().abs().max()) == 448.0  # the largest value lands on e4m3fn's max
    q0, s0 = fp8_per_tensor(torch.zeros(8))
    assert s0.item() == 1.0 and not q0.float().any()


def test_float_conversions_round_like_torch_and_others_are_refused():
    x = torch.randn(1000)
    assert torch.equal(convert(x, torch.bfloat16), x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp8 needs a scale"):
        convert(x, FP8)
    with pytest.raises(ValueError, match="takes"):
        convert(torch.arange(4), torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        fp8_blockwise(torch.zeros(2, 2, 2))
