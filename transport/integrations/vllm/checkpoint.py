"""The tensors a checkpoint of a vLLM model holds: names, shapes and dtypes, without memory."""

from __future__ import annotations

from typing import Any

import torch

#: how a trainer names its tensors: as transformers holds the model in memory ("model": a
#: mixture of experts' experts fused, ``mlp.experts.gate_up_proj`` [experts, 2 x intermediate,
#: hidden]), or as its saved checkpoint does ("checkpoint": one tensor per expert matrix,
#: ``mlp.experts.0.gate_proj.weight``, what vLLM's loader reads from disk)
NAMES = ("model", "checkpoint")


def checkpoint_spec(
    hf_config: Any, dtype: torch.dtype, names: str = "model"
) -> dict[str, torch.Tensor]:
    """Meta tensors named, shaped and typed like the parameters of a Hugging Face model of
    ``hf_config`` (what a trainer's ``model.state_dict()`` holds, tied weights once), in
    ``dtype``; with ``names="checkpoint"``, as its saved checkpoint holds them (transformers'
    own conversion from the names in memory to the names on disk). vLLM's ``load_weights``
    takes either; its own fusing and tensor-parallel sharding happen there. Built by
    transformers on the meta device: no memory, no download."""
    if names not in NAMES:
        raise ValueError(f"checkpoint names are one of {NAMES}, got {names!r}")
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
    spec = dict(model.named_parameters())
    if names == "model":
        return spec
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, spec))
