"""vLLM receives weights through transport: a weight-transfer backend named ``"transport"``.

vLLM finds it through the ``vllm.general_plugins`` entry point (:func:`register`), in every
process it starts. Inference side: :class:`~transport.integrations.vllm.worker.TransportEngine`,
one per vLLM worker (every TP and DP rank), a staging subscriber of the trainer's weight group.
Trainer side: :class:`~transport.integrations.vllm.trainer.TransportTrainer`, which publishes
with a :class:`~transport.WeightPublisher` and drives vLLM's four update phases through vLLM's
own clients (HTTP, or :class:`~transport.integrations.vllm.trainer.OfflineClient` for an
in-process ``vllm.LLM``).

Nothing here imports vLLM until one of those classes is used.
"""

from transport.integrations.vllm.plugin import BACKEND, register

__all__ = ["BACKEND", "register"]
