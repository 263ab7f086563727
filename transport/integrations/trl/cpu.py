"""TRL's ``AsyncGRPOTrainer`` on a torch without CUDA (a CPU trainer).

TRL 1.16 assumes a GPU in two places: building the trainer asks CUDA for the device's name
(for its FLOPs metric), and its packed "tree" attention runs FlashAttention-3 from the kernel
hub. :func:`cpu_trainer` covers both, where torch has no CUDA and only there::

    with cpu_trainer():
        trainer = AsyncGRPOTrainer(...)
    trainer.train()

Inside the block, ``torch.cuda.get_device_name`` answers "cpu" (TRL then leaves its FLOPs
metric out); on leaving it, the block restores it and registers :func:`tree_attention` under
TRL's attention name through transformers' ``AttentionInterface`` (TRL registers its kernel
while the trainer is built, so this comes after). Where torch has CUDA the block does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

#: the attention implementation TRL's AsyncGRPO models are built with
TREE_ATTENTION = "tree_fa3"


def tree_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """TRL's tree attention (FlashAttention's variable-length causal attention over each
    sample's keys, ``tree_kv_index`` gathering them) with torch's own attention, one sample at
    a time: query ``i`` of a sample with ``q`` queries and ``k`` keys sees keys up to
    ``i + k - q``, as FlashAttention's causal mask aligns them."""
    if softcap:
        raise NotImplementedError("transport's CPU tree attention has no logit soft-capping")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (tokens, heads, dim)
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: heads per key/value head
    out = torch.empty_like(q)
    qs, ks = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for i in range(len(qs) - 1):
        sq = q[qs[i] : qs[i + 1]].transpose(0, 1)
        sk = k[ks[i] : ks[i + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        sv = v[ks[i] : ks[i + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        nq, nk = sq.shape[1], sk.shape[1]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        if sliding_window:
            mask &= ~torch.ones_like(mask).tril(nk - nq - sliding_window)
        o = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask, scale=scaling)
        out[qs[i] : qs[i + 1]] = o.transpose(0, 1)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def cpu_trainer() -> Iterator[None]:
    """Build TRL's AsyncGRPOTrainer inside this block on a torch without CUDA (module
    docstring); a no-op where torch has CUDA."""
    if torch.cuda.is_available():
        yield
        return
    from transformers import AttentionInterface, AttentionMaskInterface

    name_of = torch.cuda.get_device_name
    torch.cuda.get_device_name = _cpu_name
    try:
        yield
    finally:
        torch.cuda.get_device_name = name_of
    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)


def _cpu_name(device: Any = None) -> str:
    return "cpu"


def _no_mask(**kwargs: Any) -> None:
    return None
