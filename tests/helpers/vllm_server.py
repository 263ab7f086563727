"""vLLM's OpenAI-compatible HTTP server (the CPU build) as a test runs it: its own process group
(kill -9 takes the API server, the engine core and every worker), its output in a log file the
failure message quotes, the weight-update routes on (dev mode)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from helpers.llama import NEW_TOKENS, PROMPTS
from helpers.processes import free_port


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` for the model in ``model_dir`` with the
    ``transport`` weight-transfer backend; ``tp`` tensor-parallel workers (one core each)."""

    def __init__(
        self, model_dir: Path, log: Path, tp: int = 1, port: int | None = None,
        start_timeout: float = 240, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.model = str(model_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(k % (os.cpu_count() or 1)) for k in range(tp)),
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--block-size", "32",
            "--seed", "0", "--skip-tokenizer-init", "--tensor-parallel-size", str(tp),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--weight-transfer-config", '{"backend": "transport"}',
        ]  # fmt: skip
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > end:
                raise AssertionError(f"vLLM server not healthy within {timeout} s:\n{self.tail()}")
            threading.Event().wait(0.5)  # sync-ok: the poll interval of a deadline-bounded wait

    def tail(self, lines: int = 40) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])

    def generate(self) -> list[list[int]]:
        """Greedy tokens of every prompt of helpers.llama.PROMPTS."""
        out = []
        for prompt in PROMPTS:
            r = requests.post(
                f"{self.url}/v1/completions",
                json={
                    "model": self.model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                },  # fmt: skip
                timeout=60,
            )
            r.raise_for_status()
            out.append(list(r.json()["choices"][0]["token_ids"]))
        return out

    def get(self, route: str) -> Any:
        r = requests.get(f"{self.url}/{route}", timeout=30)
        r.raise_for_status()
        return r.json()

    def kill(self) -> None:
        """kill -9 of every process of the server."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """kill -9 as well: a graceful stop of the CPU build takes tens of seconds, and what
        the tests check never depends on it."""
        if self.proc.poll() is None:
            self.kill()
        try:  # workers left behind in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
