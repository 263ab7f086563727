"""Whether a vLLM worker may receive a version straight into the parameters it computes with.

Writing in place needs no staging memory and no load, but it is right only for a parameter that
vLLM computes with **as stored**: the tensor its loader fills is the tensor its kernels read,
with nothing derived from it after loading. That holds for plain (unquantized) linear and
embedding layers and for norms on vLLM's GPU builds. It does not hold where vLLM transforms
weights after loading: a quantization method other than the unquantized ones (repacked,
rescaled or shuffled weights), or vLLM's CPU build, which packs a copy of every linear weight
for oneDNN (and drops the parameter) and computes with that copy. :func:`refusals` checks each
parameter of a worker's layout against these rules and says why for each one that fails; the
worker writes in place only when none does.

It reads the model's own modules (their ``quant_method`` and, on the CPU build, the
``cpu_linear`` vLLM picked for them); nothing of the transport core. The mode itself is
modes/inplace.py.
"""

from __future__ import annotations

from typing import Any

import torch

from transport.integrations.vllm.shards import WorkerLayout

#: vLLM's quantization methods whose layers compute with their parameters as loaded (the CPU
#: build aside, which :func:`refusals` checks by the kernel it picked)
AS_STORED = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def refusals(model: torch.nn.Module, layout: WorkerLayout) -> dict[str, str]:
    """Why each tensor of ``layout`` cannot be written in place into ``model`` (vLLM's model of
    this worker); empty when every one can."""
    from vllm.platforms import current_platform

    out = {
        n: f"it travels whole through vLLM's loader ({why})" for n, why in layout.fallback.items()
    }
    cpu = current_platform.is_cpu()
    for name, target in layout.targets.items():
        params = [_param(model, full) for full in target.holders]
        live, layer = params[0]
        method = getattr(layer, "quant_method", None)
        if any(p is None or p.is_meta for p, _ in params):
            why = "vLLM's model holds no such tensor"
        elif len({p.data_ptr() for p, _ in params if p is not None}) > 1:
            why = f"its names {list(target.holders)} are separate tensors in vLLM's model"
        elif tuple(live.shape) != target.shape or live.dtype != target.dtype:
            why = (
                f"vLLM computes with it as {tuple(live.shape)} {live.dtype}, not as its loader "
                f"writes it ({target.shape} {target.dtype})"
            )
        elif not live.is_contiguous():
            why = "vLLM computes with it in another memory order than its loader writes it"
        elif method is not None and type(method).__name__ not in AS_STORED:
            why = f"its layer's {type(method).__name__} may transform it after loading"
        elif cpu and getattr(layer, "cpu_linear", torch.nn.functional.linear) is not (
            torch.nn.functional.linear
        ):
            why = "vLLM's CPU build computes with a packed copy of it (oneDNN), not with it"
        else:
            continue
        out[name] = why
    return out


def live_tensors(model: torch.nn.Module, layout: WorkerLayout) -> dict[str, torch.Tensor]:
    """The tensors a worker in place receives into: each target's parameter (its leading rows
    that the checkpoint fills; the padding rows stay as vLLM's loader left them, zero), in the
    shape its layout declares."""
    out = {}
    for name, target in layout.targets.items():
        live, _ = _param(model, target.holders[0])
        assert live is not None  # refusals() said so
        shape = layout.dest[name].shape
        if len(shape) != live.dim():  # received as a view with its leading dims merged
            out[name] = live.data.view(shape)
        else:
            out[name] = live.data[: target.rows] if target.rows < live.shape[0] else live.data
    return out


def _param(model: torch.nn.Module, full: str) -> tuple[Any, Any]:
    """(the parameter named ``full``, its module), None for what is missing."""
    layer_name, _, attr = full.rpartition(".")
    try:
        layer = model.get_submodule(layer_name)
    except AttributeError:
        return None, None
    return getattr(layer, attr, None), layer
