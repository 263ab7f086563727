"""TRL trains through transport: its ``AsyncGRPOTrainer`` takes
:class:`~transport.integrations.trl.transfer.TransportWeightTransfer` as its ``weight_transfer``
and syncs every version into a vLLM server through the ``transport`` backend (vLLM's side is
``transport.integrations.vllm``), whole models or LoRA adapters.

``cpu.py`` lets TRL's trainer run where torch has no CUDA (a CPU trainer: tests, laptops).
Nothing here imports TRL, vLLM or transformers until it is used.
"""

from transport import SyncError
from transport.integrations.trl.transfer import TransportWeightTransfer

__all__ = ["SyncError", "TransportWeightTransfer"]
