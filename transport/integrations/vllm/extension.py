"""A vLLM worker extension that reports the ``transport`` engine's state of every worker.

Start vLLM with ``--worker-extension-cls transport.integrations.vllm.extension.TransportState``
(``worker_extension_cls=`` for ``LLM``); then ``llm.collective_rpc("transport_state")``, or
``POST /collective_rpc {"method": "transport_state"}`` on a server in dev mode, returns one
dict per worker: :class:`~transport.integrations.vllm.infos.EngineState` (mode, the version
the model holds, bytes per version, staging memory, what travels whole and why, the experts it
receives); ``"experts_hosted"``, vLLM's own map of the experts each worker hosts (to compare).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def install_adapter(worker: Any, update_info: dict[str, Any]) -> int | None:
    """On one vLLM worker: install the version of a LoRA adapter that ``update_info`` names
    (``{"adapter": ..., "version": ..., "timeout": ...}``; see modes/lora.py). Offline,
    ``llm.collective_rpc(install_adapter, args=(update_info,))`` runs it on every worker
    without a worker extension."""
    return _engine(worker).update_adapter(update_info)


def remove_adapter(worker: Any, namespace: str, adapter: str) -> bool:
    """On one vLLM worker: take ``adapter`` of ``namespace`` out of vLLM and leave its group."""
    return _engine(worker).remove_adapter(namespace, adapter)


def _engine(worker: Any) -> Any:
    engine = getattr(getattr(worker, "worker", worker), "weight_transfer_engine", None)
    if engine is None or not hasattr(engine, "update_adapter"):
        raise RuntimeError(
            "this vLLM worker has no transport weight-transfer engine: start vLLM with "
            '--weight-transfer-config \'{"backend": "transport"}\''
        )
    return engine


class TransportState:
    """Mixed into vLLM's worker class by vLLM (it owns nothing; it reads the worker's engine)."""

    def transport_adapter_update(self, update_info: dict[str, Any]) -> int | None:
        """:func:`install_adapter` on this worker (``POST /collective_rpc`` on a server)."""
        return install_adapter(self, update_info)

    def transport_adapter_remove(self, namespace: str, adapter: str) -> bool:
        """:func:`remove_adapter` on this worker."""
        return remove_adapter(self, namespace, adapter)

    def transport_state(self) -> dict[str, Any] | None:
        """This worker's engine state as JSON-ready values (None without the transport backend)."""
        engine = getattr(self, "weight_transfer_engine", None)
        state = getattr(engine, "state", None)
        return None if state is None else dataclasses.asdict(state())

    def experts_hosted(self) -> dict[str, list[int]]:
        """vLLM's own expert map of this worker: per fused MoE layer, the global experts it
        hosts (every one without expert parallelism)."""
        from transport.integrations.vllm.experts import hosted

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return hosted(model)
