"""How a bench writer drives its readers, on one host or across hosts.

Every bench run is one *writer* (it measures) and one or more *readers* (they expose memory and
serve). They meet in a store and a namespace as ordinary Transport peers, and the writer drives
the readers with small commands: msgpack notifications ``{"k": kind, ...}`` over the Transport
itself, each answered by one reply (``{"k": "error", "msg": ...}`` when the reader failed).
Larger blobs (raw NIXL agent metadata, addresses of a thousand tensors) go through the store
under ``transport-bench/<namespace>/<peer>/<what>``.

By default the writer is the ``transport bench ...`` process itself: it hosts an embedded store
on a free port and starts the readers as child processes (``--role reader``). With ``--store URL
--role writer|reader`` the same code runs on different hosts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from transport import PeerWaitTimeout, TransferTimeout, Transport
from transport.cli import CliError
from transport.errors import StoreError, StoreTimeout, WireFormatError
from transport.store import Store

PREFIX = "transport-bench"
MAX_MESSAGE = 60 << 10


def encode(cmd: str, **fields: Any) -> bytes:
    data: bytes = msgpack.packb({"k": cmd, **fields}, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"bench command {cmd!r} is {len(data)} bytes; put large data in the store")
    return data


def decode(data: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(data, raw=False, max_bin_len=MAX_MESSAGE, max_str_len=MAX_MESSAGE)
    except Exception as e:
        raise WireFormatError(f"a bench message could not be decoded: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("k"), str):
        raise WireFormatError(f"a bench message is not a map with a kind: {data[:80]!r}")
    return msg


def blob_key(namespace: str, peer: str, what: str) -> str:
    return f"{PREFIX}/{namespace}/{peer}/{what}"


def put_blob(store: Store, namespace: str, peer: str, what: str, obj: Any) -> None:
    store.set(blob_key(namespace, peer, what), msgpack.packb(obj, use_bin_type=True))


def get_blob(store: Store, namespace: str, peer: str, what: str, timeout: float) -> Any:
    try:
        data = store.get(blob_key(namespace, peer, what), timeout=timeout)
    except StoreTimeout as e:
        raise CliError(f"peer {peer!r} did not publish its {what} within {timeout:.0f} s") from e
    return msgpack.unpackb(data, raw=False)


class Channel:
    """The writer's side: commands to readers and their replies."""

    def __init__(
        self, t: Transport, timeout: float = 300.0, alive: Callable[[], None] | None = None
    ) -> None:
        self.t, self.timeout, self.alive = t, timeout, alive
        self.cpu_s: dict[str, float] = {}  # each reader's CPU time, from its latest reply
        self.hosts: dict[str, str] = {}

    def send(self, peer: str, cmd: str, **fields: Any) -> None:
        self.t.notify(peer, encode(cmd, **fields))

    def recv(self, peer: str, timeout: float | None = None) -> dict[str, Any]:
        limit = self.timeout if timeout is None else timeout
        end = time.monotonic() + limit
        while True:
            try:
                n = self.t.wait_notification(timeout=0.25, peer=peer)
            except TransferTimeout:
                if self.alive is not None:
                    self.alive()
                if time.monotonic() > end:
                    raise CliError(f"reader {peer!r} did not answer within {limit:.0f} s") from None
                continue
            msg = decode(n.payload)
            if msg["k"] == "error":
                raise CliError(f"reader {peer!r} failed: {msg.get('msg', '?')}")
            if isinstance(msg.get("cpu"), float):
                self.cpu_s[peer] = msg["cpu"]
            if isinstance(msg.get("host"), str):
                self.hosts[peer] = msg["host"]
            return msg

    def cpu_here(self) -> float:
        """CPU seconds used so far by the readers on this host, as their latest replies said."""
        here = socket.gethostname()
        return sum(v for p, v in self.cpu_s.items() if self.hosts.get(p) == here)

    def ask(
        self,
        peers: Sequence[str],
        cmd: str,
        per_peer: Callable[[int], dict[str, Any]] | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> list[dict[str, Any]]:
        """Send ``cmd`` to every peer (``per_peer(i)`` adds fields), then collect every reply."""
        for i, p in enumerate(peers):
            self.send(p, cmd, **fields, **(per_peer(i) if per_peer else {}))
        return [self.recv(p, timeout) for p in peers]


Handler = Callable[[dict[str, Any]], dict[str, Any] | None]


def serve(
    t: Transport,
    handlers: dict[str, Handler],
    progress: Callable[[], object] | None,
    wait_s: float,
) -> tuple[str, bool]:
    """The reader's loop: wait for a writer's commands, run each handler and send its reply (a
    handler may return None to reply later itself), until "done". ``progress`` is called at
    least every 0.5 ms (raw NIXL targets need it). Returns the writer's name and whether it
    said it failed.

    Raises CliError when no writer turns up within ``wait_s`` or the writer goes away."""
    writer: str | None = None
    start = last_look = time.monotonic()
    step = 0.0005 if progress is not None else 0.05
    while True:
        if progress is not None:
            progress()
        try:
            n = t.wait_notification(timeout=step)
        except TransferTimeout:
            now = time.monotonic()
            if now - last_look > 2.0:
                last_look = now
                if writer is None and now - start > wait_s:
                    raise CliError(
                        f"no writer contacted reader {t.name!r} within {wait_s:.0f} s"
                    ) from None
                if writer is not None and writer not in {p.name for p in t.peers()}:
                    raise CliError(f"the writer {writer!r} went away") from None
            continue
        if writer is not None and n.peer != writer:
            continue
        msg = decode(n.payload)
        writer = n.peer
        kind = msg["k"]
        if kind == "done":
            t.notify(writer, encode("bye", cpu=time.process_time()))
            return writer, bool(msg.get("failed"))
        handler = handlers.get(kind)
        try:
            if handler is None:
                raise CliError(
                    f"unknown bench command {kind!r} (writer and reader of different versions?)"
                )
            reply = handler(msg)
        except Exception as e:
            with contextlib.suppress(Exception):
                t.notify(
                    writer, encode("error", msg=f"{type(e).__name__}: {e}".splitlines()[0][:2000])
                )
            raise
        if reply is not None:
            reply.setdefault("cpu", time.process_time())
            t.notify(writer, encode(reply.pop("k", "ok"), **reply))


def linger(t: Transport, writer: str, timeout: float = 10.0) -> None:
    """After "done": stay until the writer has left (this process may host the store it uses)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if writer not in {p.name for p in t.peers()}:
                return
        except StoreError:
            return
        time.sleep(0.05)


# -- local runs: the readers as child processes ----------------------------------------------------


_BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_transport_tree", {tree!r})
tree = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tree)
tree.use_tree({dirs!r})
from transport.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _reader_bootstrap() -> str:
    """``python -c`` code that runs ``transport`` from the very directories this process imported
    it from (an editable install, a worktree a benchmark put first on the path, ...): the readers
    must measure the same code as the writer."""
    import transport
    import transport.backends
    from transport.cli.bench import _tree

    dirs = {
        "transport": os.path.dirname(os.path.abspath(transport.__file__)),
        "transport.backends": os.path.dirname(os.path.abspath(transport.backends.__file__)),
    }
    return _BOOTSTRAP.format(tree=os.path.abspath(_tree.__file__), dirs=dirs)


class LocalReaders:
    """Reader child processes (``transport bench <cmd> --role reader``); their stderr goes to a temporary file whose last line explains a failure."""

    def __init__(
        self,
        command: Sequence[str],
        names: Sequence[str],
        store_url: str,
        namespace: str,
        cpus: Sequence[int | None],
        env: dict[str, str] | None = None,
    ) -> None:
        self.names = list(names)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        for name, cpu in zip(names, cpus, strict=True):
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open until the reader is done
                prefix=f"{PREFIX}-{name}-", suffix=".log", delete=False
            )
            argv = [
                sys.executable, "-c", _reader_bootstrap(), "bench", *command, "--role", "reader",
                "--store", store_url, "--name", name, "--namespace", namespace,
            ]  # fmt: skip
            if cpu is not None:
                argv += ["--cpu", str(cpu)]
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    env={**os.environ, **(env or {})},
                )  # fmt: skip
            )

    def _last_line(self, i: int) -> str:
        try:
            with open(self.logs[i].name, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "?"
        return lines[-1] if lines else "(no output)"

    def check(self) -> None:
        """CliError when a reader has exited with an error."""
        for i, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None and rc != 0:
                raise CliError(
                    f"reader {self.names[i]!r} exited with status {rc}: {self._last_line(i)} "
                    f"(log: {self.logs[i].name})"
                )

    def cpu_seconds(self) -> float:
        """CPU time the readers have used so far (from /proc; 0 where it cannot be read)."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def close(self, timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        failed = [i for i, p in enumerate(self.procs) if p.returncode not in (0, -9)]
        for i, log in enumerate(self.logs):
            log.close()
            if i not in failed:
                with contextlib.suppress(OSError):
                    os.unlink(log.name)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.close(5.0)


def wait_for_readers(
    t: Transport, names: Sequence[str], timeout: float, alive: Callable[[], None] | None
) -> None:
    end = time.monotonic() + timeout
    for name in names:
        while True:
            try:
                t.wait_for_peer(name, timeout=0.5)
                break
            except PeerWaitTimeout:
                if alive is not None:
                    alive()
                if time.monotonic() > end:
                    raise CliError(
                        f"reader {name!r} did not join namespace {t.namespace!r} within {timeout:.0f} s; "
                        f"start it with: transport bench ... --role reader --name {name} --store URL"
                    ) from None
