"""Child processes driven over a pipe: the parent sends (command, args), the child answers
("ok", result) or ("err", message). Every call has a deadline; nothing here sleeps."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
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


class ChildError(RuntimeError):
    """The child failed a command (its exception's message), or died."""


class ChildProcess:
    """Starts the child; with ``wait=False`` the constructor returns at once and :meth:`started`
    waits for the child to be ready (children start in parallel)."""

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
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        env_backup = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            self.proc = ctx.Process(target=target, args=(child_conn, name, *args), daemon=True)
            self.proc.start()
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
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            wait_until_stopped(self.proc.pid, 30.0)

    def kill(self) -> None:
        """kill -9, and reap the process."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

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
