"""Conversions a destination may ask for: another float dtype, or fp8 e4m3 with scales.

fp8 follows the convention of DeepSeek-V3 and vLLM's block-quantized checkpoints: a scale is
``amax / 448`` (448 is e4m3's largest finite value) of its block (or of the whole tensor), the
stored value ``x / scale`` rounded to e4m3, and ``q.float() * scale`` the dequantized tensor. A
block (or tensor) of zeros gets scale 1. The scales travel as their own float32 tensor, part of
the same version. Torch ops only, on the tensor's own device (CPU here; the same ops run on a
GPU, untested there).
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
#: the largest finite float8 e4m3fn value
FP8_MAX = float(torch.finfo(FP8).max)

#: dtypes a float source may be converted to on its way (the source dtype itself included)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (round to nearest even), for float dtypes; fp8 needs scales: use
    :func:`fp8_per_tensor` or :func:`fp8_blockwise`."""
    if dtype == FP8:
        raise ValueError("fp8 needs a scale: use fp8_per_tensor() or fp8_blockwise()")
    if x.dtype not in FLOATS or dtype not in FLOATS:
        raise ValueError(f"convert() takes {FLOATS} to one another, got {x.dtype} to {dtype}")
    return x.to(dtype)


def fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` in e4m3, its scale as a 1-element float32 tensor)."""
    amax = x.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(1)
    return (x.float() / scale).to(FP8), scale


def fp8_blockwise(
    x: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(2-D ``x`` in e4m3, float32 scales of shape ``(ceil(rows / block[0]), ceil(cols /
    block[1]))``, one per block; edge blocks are partial)."""
    if x.dim() != 2:
        raise ValueError(f"block scales are for 2-D tensors; {tuple(x.shape)} has {x.dim()} dims")
    (rows, cols), (br, bc) = x.shape, block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    if rows % br == 0 and cols % bc == 0:  # whole blocks: no padding, scales broadcast
        xv = x.reshape(nr, br, nc, bc)
        amax = torch.maximum(xv.amax(dim=(1, 3)).abs(), xv.amin(dim=(1, 3)).abs()).float()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xv.float() / scale[:, None, :, None]).to(FP8)
        return q.reshape(rows, cols), scale
    xf = x.float()
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = xf.abs()
    amax = padded.view(nr, br, nc, bc).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (xf / full).to(FP8), scale


def fp8_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The float32 tensor ``q`` (e4m3) and its scales stand for."""
    if block is None:
        return q.float() * scale
    rows, cols = q.shape
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * full
