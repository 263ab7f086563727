"""A version into vLLM's model through one layerwise reload: what the staged and the streamed
modes share (the in-place mode needs no load)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from transport import TornModelError
from transport.integrations.vllm import experts
from transport.integrations.vllm.infos import TORN
from transport.integrations.vllm.modes.base import Worker
from transport.integrations.vllm.reload import (
    direct_loaders,
    load_direct,
    load_tied,
    unloaded_layers,
)
from transport.integrations.vllm.shards import WorkerLayout


def load_version(
    worker: Worker,
    layout: WorkerLayout,
    parts: Iterable[Mapping[str, torch.Tensor]],
    version: int,
    count: int = 1,
) -> None:
    """Load ``parts`` (``count`` of them, as they come) of ``version`` in one layerwise reload:
    each layer materialized, loaded, processed as after vLLM's own load and copied into the
    tensors the model computes with. Raises what stopped it when nothing reached the model, and
    :class:`TornModelError` when some parts, or not every layer, did."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model: Any = worker.model  # a vLLM model: it has load_weights
    group = worker.info.group
    targets = layout.targets
    loaded, failed = 0, None
    missing: list[str] = []
    with direct_loaders(model, targets):
        initialize_layerwise_reload(model)
        try:
            for tensors in parts:
                load_direct(model, {n: targets[n] for n in tensors if n in targets}, tensors)
                rest = {n: tensors[n] for n in tensors if n in layout.fallback}
                if rest:
                    model.load_weights(rest.items())
                    load_tied(model, worker.tied, rest)
                loaded += 1
            missing = unloaded_layers(model)
        except BaseException as e:
            failed = e
        finally:
            # finish the reload even after a failed load: it started by moving the layers
            # to the meta device; then prepare the experts vLLM leaves unprepared
            prepared = experts.reloaded(model)
            finalize_layerwise_reload(model, worker.model_config)
            experts.redo(model, prepared)
    if failed is not None:
        if loaded == 0:
            raise failed  # nothing of it reached the model
        raise TornModelError(
            f"version {version} of group {group} stopped after {loaded} of its {count} parts "
            f"({failed}): the layers of those parts hold it, the others the version before, "
            f"so the model holds no whole version and reports {TORN} until the next update "
            "loads one whole",
            version,
        ) from failed
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    if missing:
        raise TornModelError(
            f"version {version} of group {group} did not reach every layer of "
            f"the model: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            + " kept their previous weights (vLLM's loader took none of the checkpoint "
            "tensors for them), so the model now holds no whole version; the next "
            "update that reaches every layer makes it whole again",
            version,
        )
