"""What vLLM's layerwise reload does not do by itself for the models people serve.

vLLM reloads weights layer by layer: ``initialize_layerwise_reload`` gives every layer fresh
tensors on the meta device and wraps their loaders; a layer is rebuilt once its loaders took
every element; at ``finalize_layerwise_reload`` a layer that took nothing gets its previous
tensors back, with a warning only. Two consequences this module answers:

* **Tied parameters.** A model whose output head shares the input embedding
  (``tie_word_embeddings``: Llama 3.2 1B/3B, Qwen2.5 0.5B-3B) holds one tensor under two names;
  the checkpoint has it once, and the model's ``load_weights`` skips the head's name. The reload
  gives each layer its own tensor, so the head would keep the old embedding (and, on the CPU
  build, the old repacked copy): vLLM would serve a model that is half the new version.
  :func:`tied_parameters` records, before the reload, which names are one tensor, and
  :func:`load_tied` feeds each such name that the loader left empty from the checkpoint tensor
  of the name it shares, through its own weight loader (which shards it for this TP rank).
* **A layer left behind must be loud.** :func:`unloaded_layers` names every layer with
  parameters that took nothing of the version (a layer of buffers only, such as a rotary cache,
  is derived from the config and keeps its tensors rightly). The caller fails the update with
  them, since the model then holds no whole version.

It reads vLLM's reload bookkeeping (``get_layerwise_info``, in the ``__all__`` of vLLM's layerwise module) and
the model's own modules; nothing of the transport core.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from transport.integrations.vllm.shards import Target


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name of ``model`` that is the same tensor as an earlier name, mapped to
    that first name (``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def load_tied(
    model: torch.nn.Module, tied: Mapping[str, str], tensors: Mapping[str, torch.Tensor]
) -> None:
    """During a layerwise reload, after ``load_weights``: load each tied name the loader left
    empty from the checkpoint tensor of the name it shares (when the checkpoint has it by that
    name; otherwise it stays empty and :func:`unloaded_layers` names its layer)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for alias, shared in tied.items():
        source = tensors.get(shared)
        if source is None:
            continue
        layer_name, _, param_name = alias.rpartition(".")
        layer = model.get_submodule(layer_name)
        info = get_layerwise_info(layer)
        if not info.can_load() or info.load_numel > 0:
            continue  # not being reloaded, or the model's loader filled it itself
        param: Any = getattr(layer, param_name)
        param.weight_loader(param, source)


def unloaded_layers(model: torch.nn.Module) -> list[str]:
    """During a layerwise reload, before it is finalized: the layers with parameters that took
    nothing of the version (finalizing puts their previous tensors back)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for name, layer in model.named_modules():
        if not any(p is not None for p in layer._parameters.values()):  # noqa: SLF001 - torch's own table
            continue  # buffers only (a rotary cache): derived, nothing to load
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel <= 0 and (info.load_numel_total or 0) > 0:
            out.append(name or type(layer).__name__)
    return out


_NONE = object()  # a tensor without a weight_loader of its own


def _direct_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """A parameter's loader for a tensor already in the parameter's format (its leading rows;
    the rows past them are padding and become zero), or the whole parameter viewed with its
    leading dims merged (experts received from one tensor per expert matrix)."""
    if loaded_weight.dim() != param.dim():
        param.data.view(loaded_weight.shape).copy_(loaded_weight)
        return
    rows = loaded_weight.shape[0]
    param.data[:rows].copy_(loaded_weight)
    if rows < param.shape[0]:
        pad = param.data[rows:]
        pad.copy_(torch.zeros((), dtype=pad.dtype, device=pad.device).expand_as(pad))


@contextmanager
def direct_loaders(model: torch.nn.Module, targets: Mapping[str, Target]) -> Iterator[None]:
    """Around a layerwise reload (enter before ``initialize_layerwise_reload``, leave after it
    is finalized): the parameters of ``targets`` load through a direct copy instead of their
    checkpoint loader, so :func:`load_direct` can hand them tensors in their own format and
    vLLM's reload still materializes each layer, runs its post-load processing (the CPU build's
    oneDNN repacking) and copies the result into the tensors the model computes with. The
    loaders are put back after."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    saved: list[tuple[Any, Any]] = []
    try:
        for target in targets.values():
            for full in target.holders:
                layer_name, _, attr = full.rpartition(".")
                layer = model.get_submodule(layer_name)
                recorded, _ = get_layerwise_info(layer).restore_metadata
                # vLLM rebuilds a reloaded layer from its recorded meta tensors; the bias is not
                # recorded and stays live
                template = recorded.get(attr, getattr(layer, attr))
                # an attribute, or a property of vLLM's parameter classes: get and set it
                saved.append((template, getattr(template, "weight_loader", _NONE)))
                template.weight_loader = _direct_loader  # type: ignore[attr-defined]
        yield
    finally:
        for template, loader in reversed(saved):
            if loader is _NONE:
                del template.weight_loader
            else:
                template.weight_loader = loader


def load_direct(
    model: torch.nn.Module, targets: Mapping[str, Target], tensors: Mapping[str, torch.Tensor]
) -> None:
    """During a layerwise reload entered with :func:`direct_loaders`: load each target's tensor
    into every parameter that holds it (tied ones too), in its own format."""
    for name, target in targets.items():
        source = tensors[name]
        for full in target.holders:
            layer_name, _, attr = full.rpartition(".")
            param: Any = getattr(model.get_submodule(layer_name), attr)
            param.weight_loader(param, source)
