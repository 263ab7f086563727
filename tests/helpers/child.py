"""Child processes driven over a pipe: the parent sends (command, args), the child answers
("ok", result) or ("err", message). Every call has a deadline; nothing here sleeps.

Children fork from a server process that imported torch and ``transport`` once
(``multiprocessing``'s forkserver, started at the test process's first child): a child starts
without importing them again. The child takes the parent's environment as it is at the start
(the forkserver's own is that of its start), and is signalled through a pidfd, which cannot
name another process once it is gone. A child started while the calling thread is in another
network namespace (helpers.netns) is spawned there instead: forked by the server, it would be
born in the server's namespace.

A child whose class sets ``FROM_VLLM_SERVER`` (a vLLM engine, vLLM's trainer side, a trainer
that builds its model with transformers) forks from a second server, which imported vLLM and
transformers too (seconds of CPU per process on this kind of machine, and these tests start
dozens of them); other children never see vLLM's changes to torch's settings. Neither server
has started a Python thread when it forks (numpy's and vLLM's native pools aside). A child whose
vLLM forks processes of its own must not fork from a process with threads: the offline engines
here run everything in their own process, and vLLM's servers start theirs from their own
process (forked in the tests: helpers/startup/sitecustomize.py)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver
from typing import Any


def serve(conn: Any, handlers: dict[str, Any], close: Any) -> None:
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            close()
            conn.send(("ok", None))
            break
        try:
            result = handlers[cmd](*args)
        except BaseException as e:
            if os.environ.get("TRANSPORT_TEST_CHILD_TRACEBACKS") == "1":
                traceback.print_exc()  # into the child's stderr, which pytest shows
            conn.send(("err", f"{type(e).__name__}: {e}"))
        else:
            conn.send(("ok", result))


#: how long a child may take to start before the test fails as hung: a deadline against hangs,
#: not a claim about speed (under the full suite a plain Peer's start, a NIXL agent and its
#: record, was measured past 60 s on the 2-core machine)
START_TIMEOUT = 180.0

#: what the forkserver imports before it forks any child (importable from the installed
#: environment: the forkserver starts with Python's default path, not the test process's): the
#: library, its stores and backends and NIXL's bindings, which almost every child loads (NIXL
#: reads UCX's settings when an agent starts, not at its import)
PRELOAD = [
    "numpy",
    "torch",
    "transport",
    "transport.weights",
    "transport.store.tcp",
    "transport.store.redis",
    "transport.backends.nixl",
    "transport.backends.cma",
    "nixl._api",
]
#: what the forkserver of the children that run vLLM imports besides: its offline engine, its
#: trainer side, transformers and peft (the trainers build their models with them: eight LoRA
#: tenants importing them at once starved the tests running beside them)
VLLM_PRELOAD = [
    *PRELOAD,
    "transformers",
    "transformers.models.llama",
    "peft",
    "safetensors.torch",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.distributed.weight_transfer",
    "transport.integrations.vllm.trainer",
    "transport.integrations.vllm.worker",
    "transport.integrations.vllm.lora_trainer",
]
#: the second forkserver (multiprocessing's own serves the other children)
_VLLM_SERVER = forkserver.ForkServer()
_VLLM_SERVER.set_forkserver_preload(VLLM_PRELOAD)
#: children start one at a time: the vLLM children's start swaps the server multiprocessing uses
_STARTING = threading.Lock()
#: the network namespace this process started in (children of the forkserver are born there)
_HOME_NET = os.stat("/proc/self/ns/net").st_ino


def _context() -> Any:
    """The forkserver's context, or spawn's where the calling thread left its namespace."""
    if os.stat("/proc/thread-self/ns/net").st_ino != _HOME_NET:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextmanager
def _starting(vllm: bool) -> Iterator[None]:
    """One child's start; with ``vllm`` from the second forkserver (multiprocessing's
    forkserver Popen asks its module for the server to connect to)."""
    with _STARTING:
        if not vllm:
            yield
            return
        default = forkserver.connect_to_new_process
        forkserver.connect_to_new_process = _VLLM_SERVER.connect_to_new_process
        try:
            yield
        finally:
            forkserver.connect_to_new_process = default


def _with_environ(environ: dict[str, str], target: Any, *args: Any) -> None:
    """Run ``target(*args)`` with the parent's environment of the start, the objects inherited
    from the server frozen out of the garbage collector's passes: they are the imported modules,
    alive for the child's life, and a pass that walks them (millions with vLLM's imports) writes
    to every page of the inherited heap, which the fork then copies."""
    gc.freeze()
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


class ChildError(RuntimeError):
    """The child failed a command (its exception's message), or died."""


class ChildProcess:
    """Starts the child; with ``wait=False`` the constructor returns at once and :meth:`started`
    waits for the child to be ready (children start in parallel). A subclass whose child runs
    vLLM or transformers sets ``FROM_VLLM_SERVER``."""

    FROM_VLLM_SERVER = False

    def __init__(
        self,
        name: str,
        target: Any,
        args: tuple[Any, ...],
        start_timeout: float,
        wait: bool = True,
    ) -> None:
        self.name = name
        self.generation = self.pid = -1
        self._pidfd = -1
        ctx = _context()
        self._conn, child_conn = ctx.Pipe()
        environ = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        env_backup = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # for the forkserver or a spawned child
        try:
            self.proc = ctx.Process(
                target=_with_environ,
                args=(environ, target, child_conn, name, *args),
                daemon=True,
            )
            with _starting(self.FROM_VLLM_SERVER):
                self.proc.start()
            self._pidfd = os.pidfd_open(self.proc.pid)
        finally:
            if env_backup is None:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        child_conn.close()
        if wait:
            self.started(start_timeout)

    def started(self, timeout: float = 60) -> Any:
        """Wait until the child is ready; returns self."""
        if self.pid < 0:
            try:
                self.generation, self.pid = self._reply(timeout, "start")
            except BaseException:
                self.kill()
                raise
        return self

    def _reply(self, timeout: float, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name!r} did not answer {what!r} within {timeout} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise ChildError(f"{self.name!r} died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise ChildError(f"{self.name!r}: {value}")
        return value

    def begin(self, cmd: str, *args: Any) -> None:
        """Start ``cmd`` in the child and return at once (several children work at the same
        time); :meth:`end` waits for its result."""
        self._conn.send((cmd, args))

    def end(self, cmd: str, timeout: float = 60) -> Any:
        """The result of the command :meth:`begin` started."""
        return self._reply(timeout, cmd)

    def call(self, cmd: str, *args: Any, timeout: float = 60) -> Any:
        """Run ``cmd`` in the child; its result, or ChildError with the child's exception."""
        self._conn.send((cmd, args))
        return self._reply(timeout, cmd)

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return only once every thread of the child has stopped (the
        signal is delivered asynchronously: a put right after kill() could still be served)."""
        signal.pidfd_send_signal(self._pidfd, sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.proc.pid, 30.0)

    def kill(self) -> None:
        """kill -9, and wait for the process to be gone."""
        if self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:  # gone already
                pass
        self.proc.join(10)
        if self._pidfd >= 0 and not self.proc.is_alive():
            os.close(self._pidfd)
            self._pidfd = -1

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.signal(signal.SIGCONT)  # in case a test left it stopped
                self.call("exit", timeout=15)
            except (ChildError, TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
        self.kill()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until_stopped(pid: int, timeout: float) -> None:
    """Block until every thread of ``pid`` is in the stopped state (``T`` in /proc), or raise."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s (states {states})")
        time.sleep(0.001)  # sync-ok: polling /proc for the kernel's stop, no event exists for it
