"""The tensors a checkpoint of a vLLM model holds: names, shapes and dtypes, without memory."""

from __future__ import annotations

from typing import Any

import torch


def checkpoint_spec(hf_config: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta tensors named, shaped and typed like the parameters of a Hugging Face checkpoint of
    ``hf_config`` (what a trainer's ``model.state_dict()`` holds, tied weights once), in
    ``dtype``. vLLM's ``load_weights`` takes exactly these names; its own fusing and
    tensor-parallel sharding happen there. Built by transformers on the meta device: no memory,
    no download."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # pragma: no cover - vLLM depends on transformers
        raise RuntimeError("the transport backend for vLLM needs transformers") from e
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    except Exception as e:
        raise ValueError(
            f"cannot tell the checkpoint tensors of a {type(hf_config).__name__} model: "
            f"transformers could not build it from its config ({type(e).__name__}: {e})"
        ) from e
    return {name: p for name, p in model.named_parameters()}
