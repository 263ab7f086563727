"""vLLM's OpenAI-compatible server with the ``transport`` backend, as a child process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transport.store import PortReservation, reserve_port

#: environment the server needs: the weight-update routes (dev mode) and, on vLLM's CPU build, a
#: KV cache size (without one it asks for most of the host's memory); the caller's win
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: what a server of one worker adds: the worker in the engine core's process (vLLM's "uni"
#: executor), as vLLM's GPU builds run one. vLLM's CPU build otherwise starts the worker as a
#: process of its own, which imports vLLM once more (half of such a server's start). vLLM reads
#: the variable nowhere else in a server: its API server and engine core stay two processes.
ONE_WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its token ids and vLLM's log-probability of each."""

    tokens: list[int]
    logprobs: list[float]


def wait_healthy(url: str, timeout: float, check: Callable[[], None] | None = None) -> bool:
    """Whether the server at ``url`` answered ``/health`` within ``timeout`` seconds (asked
    every half second; ``check`` runs before each ask and may raise to give up)."""
    import requests

    end = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > end:
            return False
        threading.Event().wait(0.5)


class VllmServer:
    """Starts ``python -m vllm.entrypoints.openai.api_server`` (the module form works with every
    vLLM build; the CPU build has no ``vllm`` command) for ``model`` with
    ``--weight-transfer-config '{"backend": "transport"}'``, in its own process group, its output
    in ``log``, and waits until ``/health`` answers at ``host`` (the address it listens on).

    It owns the server's processes (the API server, the engine core, each worker; at ``tp`` = 1
    the worker runs in the engine core, ONE_WORKER_ENV): :meth:`kill` ends them all at once,
    :meth:`stop` asks first (``graceful`` seconds) and then kills. ``args`` are more server
    arguments; ``env`` more environment (``tp`` > 1 on the CPU build needs
    ``VLLM_CPU_OMP_THREADS_BIND``, for example ``"0|1"``). A server that exits or is not healthy
    within ``start_timeout`` is killed and the error quotes the end of its log."""

    def __init__(
        self,
        model: str | Path,
        log: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        tp: int = 1,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        self.model = str(model)
        self._held: PortReservation | None = None
        if port:
            self.port = port
        else:  # one of our choosing, held until the server is killed (transport/store/ports.py)
            self._held = reserve_port(host)
            self.port = self._held.port
        self.url = f"http://{host}:{self.port}"
        self.log = Path(log)
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            host,
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp),
            "--weight-transfer-config",
            '{"backend": "transport"}',
            *args,
        ]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                env={
                    **os.environ,
                    **SERVER_ENV,
                    **(ONE_WORKER_ENV if tp == 1 else {}),
                    **(env or {}),
                },
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        if not wait_healthy(self.url, timeout, self._check_running):
            raise TimeoutError(f"vLLM was not healthy within {timeout} s:\n{self.tail()}")

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The end of the server's log."""
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])

    def complete(
        self, prompts: list[list[int]], max_tokens: int, model: str | None = None
    ) -> list[list[int]]:
        """Greedy token ids continuing each prompt (token ids), in one request; ``model`` names
        a LoRA adapter to serve them with (default: the base model)."""
        return [list(c["token_ids"]) for c in self._greedy(prompts, max_tokens, model, {})]

    def complete_scored(
        self, prompts: list[list[int]], max_tokens: int, model: str | None = None
    ) -> list[Completion]:
        """:meth:`complete` with the log-probability vLLM gave each token it chose (of the
        model's logits, before any sampling setting), which tells apart weights that choose
        the same tokens."""
        choices = self._greedy(prompts, max_tokens, model, {"logprobs": 0})
        return [
            Completion(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]])
            for c in choices
        ]

    def _greedy(
        self, prompts: list[list[int]], max_tokens: int, model: str | None, more: dict[str, Any]
    ) -> list[dict[str, Any]]:
        body: dict[str, Any] = {
            "model": model or self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **more,
        }
        return sorted(self.post("v1/completions", body)["choices"], key=lambda c: c["index"])

    def get(self, route: str) -> Any:
        import requests

        r = requests.get(f"{self.url}/{route}", timeout=60)
        r.raise_for_status()
        return r.json()

    def post(self, route: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        import requests

        r = requests.post(f"{self.url}/{route}", json=body, timeout=timeout)
        if not r.ok:
            raise RuntimeError(f"vLLM {route}: {r.status_code} {r.text[:500]}")
        return r.json()

    def kill(self) -> None:
        """kill -9 of every process of the server; the port it was given goes back to the kernel
        (a server restarted on it by number needs a port of the caller's, held by the caller)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        if self._held is not None:
            self._held.close()

    def stop(self, graceful: float = 30.0) -> None:
        if self.proc.poll() is None and graceful > 0:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=graceful)
        self.kill()  # and workers left behind in the group

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
