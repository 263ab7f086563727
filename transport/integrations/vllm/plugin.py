"""Registers the ``transport`` weight-transfer backend with vLLM's factories."""

from __future__ import annotations

import contextlib

#: the name users give vLLM: ``weight_transfer_config={"backend": "transport"}``
BACKEND = "transport"


def register() -> None:
    """Register the worker engine and the trainer engine under :data:`BACKEND`. vLLM calls this
    from its ``vllm.general_plugins`` entry point in each of its processes, possibly more than
    once; a trainer process that does not run vLLM's engine calls it itself (or uses
    :class:`~transport.integrations.vllm.trainer.TransportTrainer` directly). Idempotent; without
    vLLM installed it does nothing."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    for factory, module, name in (
        (WeightTransferEngineFactory, "transport.integrations.vllm.worker", "TransportEngine"),
        (WeightTransferTrainerFactory, "transport.integrations.vllm.trainer", "TransportTrainer"),
    ):
        # registered already: vLLM loads plugins in several places
        with contextlib.suppress(ValueError):
            factory.register_engine(BACKEND, module, name)
