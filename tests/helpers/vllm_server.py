"""vLLM's HTTP server (the CPU build) as the tests run it: the small Llama in float32, token ids
in and out, each tensor-parallel worker on a core of its own, killed at the end (a graceful stop
of the CPU build takes tens of seconds, and nothing the tests check depends on it).

Its engine core and workers fork from the process that starts them where that process has no
thread besides its main one, and are spawned otherwise (helpers/startup/sitecustomize.py; vLLM's
CPU build spawns them, and each imports vLLM again: most of a server's start). An engine core
forked from an API server that had started threads was once seen to hang for good before it
began."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from helpers.llama import NEW_TOKENS, PROMPTS
from transport.integrations.vllm.server import VllmServer as Server

#: every worker reports its transport engine's state (collective_rpc "transport_state"), and its
#: collectives can be made to wait in the kernel (worker_ext/quiet_workers.py)
EXTENSION = ("--worker-extension-cls", "quiet_workers.TestWorkers")
WORKER_EXT = Path(__file__).parent / "worker_ext"
ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "128",
    "--block-size",
    "32",
    "--seed",
    "0",
    "--skip-tokenizer-init",
)


#: what a server serving transport's LoRA adapters adds: LoRA on (ranks up to 16; two adapters
#: in a batch, the tests' requests name one each; every adapter of the tests registered), the
#: adapter routes (the worker extension is EXTENSION's)
LORA_ARGS = (
    "--enable-lora",
    "--max-lora-rank",
    "16",
    "--max-loras",
    "2",
    "--max-cpu-loras",
    "12",
    "--middleware",
    "transport.integrations.vllm.lora_routes.AdapterRoutes",
)


class VllmServer(Server):
    def __init__(
        self,
        model_dir: Path,
        log: Path,
        tp: int = 1,
        port: int | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        args: tuple[str, ...] = (),
    ) -> None:
        cores = os.cpu_count() or 1
        env = dict(env or {})
        paths = (str(WORKER_EXT), env.get("PYTHONPATH") or os.environ.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        super().__init__(
            model_dir,
            log,
            port=port,
            host=host,
            tp=tp,
            args=(*ARGS, *EXTENSION, *args),
            start_timeout=240,
            env={
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(k % cores) for k in range(tp)),
                "TOKENIZERS_PARALLELISM": "false",
                **env,
            },
        )
        # a worker waiting in a collective for the other one would spin while it is not running
        # (its readers of vLLM's message queues sleep soon already: helpers/startup)
        if tp > 1:
            try:
                changed = self.post("collective_rpc", {"method": "blocking_collectives"})
                # every worker at least its tensor-parallel group (vLLM answers with text)
                assert all(int(n) >= 1 for n in changed["results"]), changed
            except BaseException:
                self.kill()
                raise

    def transport_state(self) -> list[dict[str, Any]]:
        """Each worker's transport engine state (EngineState), in rank order."""
        return list(self.post("collective_rpc", {"method": "transport_state"})["results"])

    def generate(self, model: str | None = None) -> list[list[int]]:
        """Greedy tokens of every prompt of helpers.llama.PROMPTS (``model``: a LoRA adapter)."""
        return self.complete(PROMPTS, NEW_TOKENS, model)

    def stop(self, graceful: float = 0.0) -> None:
        super().stop(graceful)
