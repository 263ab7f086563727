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

#: what :func:`adapter_call` does, by action
ADAPTER_ACTIONS = ("init", "install", "remove")


def adapter_call(worker: Any, action: str, payload: dict[str, Any]) -> dict[str, Any]:
    """On one vLLM worker, an action on a LoRA adapter (modes/lora.py): ``init`` (payload: the
    adapter's init info), ``install`` (``{"adapter", "namespace", "version", "timeout"}``) or
    ``remove`` (``{"adapter", "namespace"}``). Returns ``{"version": ...}`` (the version
    installed), ``{"removed": bool}``, ``{"joined": how}`` or ``{"error": message}``: it never
    raises, since vLLM's executor of several workers hands the other workers' error replies to
    the calls that follow one that raised. Offline, ``llm.collective_rpc(adapter_call,
    args=(action, payload))`` runs it on every worker without a worker extension."""
    try:
        engine = _engine(worker)
        if action == "init":
            return {"joined": engine.init_adapter(payload)}
        if action == "install":
            return {"version": engine.update_adapter(payload)}
        if action == "remove":
            return {"removed": engine.remove_adapter(payload["namespace"], payload["adapter"])}
        raise ValueError(f"transport adapter action {action!r} is not one of {ADAPTER_ACTIONS}")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def adapter_results(results: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    """Every worker's answer to :func:`adapter_call`; RuntimeError naming what each worker that
    failed said."""
    failed = [f"worker {k}: {r['error']}" for k, r in enumerate(results) if "error" in r]
    if failed:
        raise RuntimeError(f"{what} failed on vLLM's workers: " + "; ".join(failed))
    return results


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

    def transport_adapter(self, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        """:func:`adapter_call` on this worker (the adapter routes call it: lora_routes.py)."""
        return adapter_call(self, action, payload)

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
