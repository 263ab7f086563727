"""Child processes for tests: their output arrives line by line on a queue, so a test
waits for an event ("ready") with a deadline instead of sleeping."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from helpers.child import START_TIMEOUT
from transport.store import PortReservation, reserve_port

REPO = Path(__file__).resolve().parents[2]


#: the ports :func:`free_port` handed out, held until this process ends
_HELD: list[PortReservation] = []


def free_port() -> int:
    """A TCP port of this host that nobody else is given until this process ends: a server a
    test starts binds it by number (a restarted one too), and no other process's port 0 or
    outgoing connection lands on it meanwhile (see transport/store/ports.py)."""
    held = reserve_port()
    _HELD.append(held)
    return held.port


class LineReader:
    """Reads a pipe on a thread; ``next_line`` waits for the next line with a deadline."""

    def __init__(self, pipe: IO[str], keep: list[str] | None = None) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.seen = keep if keep is not None else []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.seen.append(line)
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line, or None at end of output; queue.Empty after ``timeout``."""
        return self._lines.get(timeout=timeout)


class PythonProcess:
    """``python -c CODE ARGS...`` run from the repository root, with piped stdio."""

    def __init__(
        self,
        code: str,
        *args: str,
        prefix: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """``prefix`` runs it through another command (``ip netns exec NS``); ``env`` adds variables."""
        full_env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", code, *args],
            cwd=REPO,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.stdout = LineReader(self.proc.stdout)
        self.stderr = LineReader(self.proc.stderr)

    def expect_line(self, timeout: float = START_TIMEOUT) -> str:
        """The child's next stdout line; fails with its stderr when it exits first or is silent
        past ``timeout`` (by default the children's start deadline: against hangs, never a
        claim about speed; a loaded machine starts a Python process in tens of seconds)."""
        try:
            line = self.stdout.next_line(timeout)
        except queue.Empty:
            raise AssertionError(
                f"child printed nothing within {timeout} s; stderr:\n{''.join(self.stderr.seen)}"
            ) from None
        if line is None:
            self.proc.wait(timeout=5)
            raise AssertionError(
                f"child exited ({self.proc.returncode}) before printing; "
                f"stderr:\n{''.join(self.stderr.seen)}"
            )
        return line

    def finish(self, timeout: float = 20.0) -> int:
        """Close the child's stdin (its cue to end) and wait for it to exit."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def __enter__(self) -> PythonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
