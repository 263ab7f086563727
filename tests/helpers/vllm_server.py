"""vLLM's HTTP server (the CPU build) as the tests run it: the small Llama in float32, token ids
in and out, each tensor-parallel worker on a core of its own, killed at the end (a graceful stop
of the CPU build takes tens of seconds, and nothing the tests check depends on it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from helpers.llama import NEW_TOKENS, PROMPTS
from transport.integrations.vllm.server import VllmServer as Server

#: every worker reports its transport engine's state (collective_rpc "transport_state")
EXTENSION = ("--worker-extension-cls", "transport.integrations.vllm.extension.TransportState")
ARGS = (
    "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--block-size", "32",
    "--seed", "0", "--skip-tokenizer-init",
)  # fmt: skip


class VllmServer(Server):
    def __init__(
        self, model_dir: Path, log: Path, tp: int = 1, port: int | None = None,
        env: dict[str, str] | None = None, host: str = "127.0.0.1", args: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        cores = os.cpu_count() or 1
        super().__init__(
            model_dir, log, port=port, host=host, tp=tp, args=(*ARGS, *EXTENSION, *args), start_timeout=240,
            env={
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(k % cores) for k in range(tp)),
                "TOKENIZERS_PARALLELISM": "false",
                **(env or {}),
            },
        )  # fmt: skip

    def transport_state(self) -> list[dict[str, Any]]:
        """Each worker's transport engine state (EngineState), in rank order."""
        return list(self.post("collective_rpc", {"method": "transport_state"})["results"])

    def generate(self) -> list[list[int]]:
        """Greedy tokens of every prompt of helpers.llama.PROMPTS."""
        return self.complete(PROMPTS, NEW_TOKENS)

    def stop(self, graceful: float = 0.0) -> None:
        super().stop(graceful)
