"""vLLM's fused mixture-of-experts layers across a weight update.

vLLM computes a mixture-of-experts layer with an *experts kernel* chosen at load
(``layer.quant_method.moe_kernel.fused_experts``). Some kernels prepare the expert weights after
loading: vLLM's CPU build (``CPUUnquantizedExperts`` and its x86, Arm and Power kinds) pads the
intermediate size to its kernel's alignment and repacks ``w13_weight`` and ``w2_weight`` into its
grouped-gemm layout. vLLM runs that step when the model loads, but on a weight update its
unquantized method only copies the new weights into the packed tensors and skips the kernel's
step, so the model then computes with unpacked bytes read as packed ones: weights that are not
the trainer's, while the update reports success. This module is what the worker does about it:

* :func:`redo` runs, after every reload (whatever the mode), the step vLLM skipped, for the
  layers that took the version (:func:`reloaded`) and whose kernel's step is a pure function
  of the loaded weights (the unquantized CPU kernels): the model then holds exactly what a
  fresh load of the same version gives.
* :func:`refusals` names, at init, every layer whose experts no update can place exactly: a
  kernel with a post-load step of another kind (vLLM skips it and we cannot redo it), or
  experts padded for their kernel (vLLM's reload copies the unpadded weights into the padded
  tensors and fails). The worker refuses to join rather than serve what it cannot update.

:func:`received` says which experts a worker's layout brings it (its state reports them).

It reads the model's own modules (their ``quant_method``); nothing of the transport core.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from transport.integrations.vllm.shards import WorkerLayout

#: the weights vLLM's fused MoE layers hold and its experts kernels prepare
WEIGHTS = ("w13_weight", "w2_weight")


def moe_layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, Any]]:
    """Every fused mixture-of-experts layer of ``model`` with its experts kernel, by name."""
    out = {}
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None:
            out[name] = (layer, experts)
    return out


def hosted(model: torch.nn.Module) -> dict[str, list[int]]:
    """vLLM's own expert map: per fused MoE layer (its module name), the global experts it
    hosts (every one where it has no expert map: no expert parallelism)."""
    out = {}
    for name, (layer, _) in moe_layers(model).items():
        emap = getattr(layer, "expert_map", None)
        if emap is None:
            out[name] = list(range(int(getattr(layer, "global_num_experts", 0))))
        else:
            out[name] = [g for g, local in enumerate(emap.tolist()) if local >= 0]
    return out


def _prepares(experts: Any) -> bool:
    """Whether the kernel changes the expert weights after loading (its own step)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    step = getattr(type(experts), "process_weights_after_loading", None)
    return step is not None and step is not FusedMoEExperts.process_weights_after_loading


def _redoable(experts: Any) -> bool:
    """Whether the kernel's step is one :func:`redo` may run again after an update: the
    unquantized CPU kernels, whose step reads only ``w13_weight`` and ``w2_weight``."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU kernels
        return False
    return isinstance(experts, CPUUnquantizedExperts)


def refusals(model: torch.nn.Module) -> dict[str, str]:
    """Why each fused MoE layer of ``model`` cannot take a weight update exactly (layer name ->
    why, with the way out); empty when every one can."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = {}
    for name, (layer, experts) in moe_layers(model).items():
        kind = type(experts).__name__
        if not _prepares(experts):
            continue
        if not _redoable(experts):
            out[name] = (
                f"its experts kernel {kind} prepares the expert weights after loading, which "
                "vLLM does not redo on a weight update; serve it with an unquantized experts "
                "kernel (or one without a post-load step)"
            )
            continue
        recorded, _ = get_layerwise_info(layer).restore_metadata
        for attr in WEIGHTS:
            live, loaded = getattr(layer, attr, None), recorded.get(attr)
            if live is None or loaded is None:
                out[name] = f"vLLM recorded no loader format for its {attr}"
                break
            if tuple(live.shape) != tuple(loaded.shape):
                out[name] = (
                    f"{kind} computes with its {attr} padded to {tuple(live.shape)}, its loader "
                    f"writes {tuple(loaded.shape)}, and vLLM's weight reload cannot copy one "
                    "into the other; serve it with an intermediate size per rank that is a "
                    "multiple of 32 (fewer tensor-parallel ranks, or expert parallelism)"
                )
                break
    return out


def reloaded(model: torch.nn.Module) -> list[str]:
    """During a layerwise reload, before it is finalized: the fused MoE layers whose kernels
    prepare their weights and that took something of this version (processed already, or
    processed when the reload is finalized). A layer that took nothing gets its prepared
    tensors back from vLLM, and must not be prepared twice."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for name, (layer, experts) in moe_layers(model).items():
        info = get_layerwise_info(layer)
        if (
            _prepares(experts)
            and _redoable(experts)
            and (not info.can_load() or info.load_numel > 0)
        ):
            out.append(name)
    return out


def redo(model: torch.nn.Module, layers: list[str]) -> None:
    """After a reload is finalized: run again the post-load step that vLLM skips on updates, for
    the ``layers`` that :func:`reloaded` named before it was finalized."""
    found = moe_layers(model)
    for name in layers:
        layer, experts = found[name]
        experts.process_weights_after_loading(layer)


#: a checkpoint tensor of one expert: ``<layer>.mlp.experts.<id>.<matrix>`` (its experts prefix,
#: its id)
_ONE_EXPERT = re.compile(r"^(.+\.experts)\.([0-9]{1,6})\.")


def received(layout: WorkerLayout, spec: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per mixture-of-experts layer (its experts' checkpoint prefix, ``...mlp.experts``), the
    experts of which this worker receives anything: all of them under tensor parallelism (a
    slice of each), its own under expert parallelism (whole experts)."""
    out: dict[str, set[int]] = {}
    for d in layout.dest.values():
        for p in d.pieces:
            one = _ONE_EXPERT.match(p.source)
            if one is not None:
                out.setdefault(one.group(1), set()).add(int(one.group(2)))
                continue
            prefix, _, _ = p.source.rpartition(".")
            if not prefix.endswith(".experts") or spec[p.source].dim() != 3:
                continue  # not a fused experts tensor ([experts, ...])
            if p.take.dim == 0:
                ids = range(p.take.start, p.take.stop)
            else:
                ids = range(spec[p.source].shape[0])
            out.setdefault(prefix, set()).update(ids)
    return {k: sorted(v) for k, v in sorted(out.items())}
