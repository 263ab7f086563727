"""A real ``redis-server`` for tests, on a free loopback port.

When ``TRANSPORT_TEST_REDIS_URL`` is set, tests use that server instead (and
FLUSHDB its database). Without redis-server installed the tests fail; they do not
skip.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import time

import redis

from helpers.processes import LineReader, free_port
from transport.store.redis import parse_redis_url

ENV_URL = "TRANSPORT_TEST_REDIS_URL"
NOT_INSTALLED = (
    "redis-server is not installed (not on PATH). The store tests need a real Redis "
    "server: run the test command in README.md, which installs it (apt-get install "
    f"redis-server), or point {ENV_URL} at a server whose database the tests may flush."
)


class RedisServer:
    """One ``redis-server`` process; ``url`` carries the password when there is one."""

    def __init__(self, *, password: str | None = None, start_timeout: float = 15.0) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError(NOT_INSTALLED)
        self.password = password
        self.proc: subprocess.Popen[str] | None = None
        last_output = ""
        for _ in range(3):  # the free port may be taken before redis binds it
            self.port = free_port()
            if self._start(executable, start_timeout):
                return
            last_output = self._output()
        raise RuntimeError(f"redis-server did not start; its output:\n{last_output}")

    def _start(self, executable: str, timeout: float) -> bool:
        args = [executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        self._reader = LineReader(self.proc.stdout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._reader.next_line(max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.stop()
                return False
            if line is None:  # exited: most likely the port was taken
                self.proc.wait(timeout=5)
                return False
            if "Ready to accept connections" in line:
                break
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )
        try:
            return bool(client.ping())
        finally:
            client.close()

    def restart(self, timeout: float = 15.0) -> None:
        """Stop the server and start an empty one on the same port (no persistence: every key
        is gone, as after a crash of a cache-only Redis)."""
        self.stop()
        executable = shutil.which("redis-server")
        assert executable is not None
        end = time.monotonic() + timeout
        while not self._start(executable, max(1.0, end - time.monotonic())):
            if time.monotonic() > end:  # the port may linger a moment after the old server
                raise RuntimeError(f"redis-server did not restart:\n{self._output()}")

    def _output(self) -> str:
        return "".join(self._reader.seen) if self.proc is not None else ""

    def url(self, db: int = 0) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def external_redis_url() -> str | None:
    """The server named by ``TRANSPORT_TEST_REDIS_URL``, if set."""
    return os.environ.get(ENV_URL) or None


#: the databases a test run uses on the Redis server, per pytest-xdist worker: the shared one
#: (never flushed: tests use namespaces of their own), then one per fixture that flushes its own
DATABASES_PER_WORKER = 3
SHARED_DB, CONFORMANCE_DB, ANY_STORE_DB = 0, 1, 2


def database(url: str, role: int) -> str:
    """``url`` moved to the database of ``role`` (SHARED_DB, CONFORMANCE_DB, ANY_STORE_DB) of this
    pytest-xdist worker (gw0 takes 0-2, gw1 3-5, ...; a run without workers, 0-2): workers never
    flush each other's databases. A Redis server has 16 unless configured otherwise."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isascii() and worker[2:].isdigit() else 0
    db = role + DATABASES_PER_WORKER * index
    if db > 15:
        raise RuntimeError(f"{worker} would use Redis database {db}: run at most 5 workers")
    return url.rsplit("/", 1)[0] + f"/{db}"


def flush(url: str) -> None:
    """Empty the database of ``url`` (each test starts from an empty store)."""
    client = redis.Redis.from_url(parse_redis_url(url)[0], socket_timeout=10)
    try:
        client.flushdb()
    finally:
        client.close()
