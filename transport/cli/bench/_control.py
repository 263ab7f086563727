"""How a bench writer drives its readers, on one host or across hosts.

Every bench run is one *writer* (it measures) and one or more *readers* (they expose memory and
serve). They meet in a store and a namespace as ordinary Transport peers, and the writer drives
the readers with small commands: msgpack notifications ``{"cmd": name, ...}`` over the Transport
itself, each answered by one reply (``{"cmd": "error", "msg": ...}`` when the reader failed).
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
Handler = Callable[[dict[str, Any]], dict[str, Any]]


def encode(cmd: str, **fields: Any) -> bytes:
    data: bytes = msgpack.packb({"cmd": cmd, **fields}, use_bin_type=True)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"bench command {cmd!r} is {len(data)} bytes; put large data in the store")
    return data


def decode(data: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(data, raw=False, max_bin_len=MAX_MESSAGE, max_str_len=MAX_MESSAGE)
    except Exception as e:
        raise WireFormatError(f"a bench message could not be decoded: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("cmd"), str):
        raise WireFormatError(f"a bench message is not a map with a command: {data[:80]!r}")
    return msg


def put_blob(store: Store, namespace: str, peer: str, what: str, obj: Any) -> None:
    store.set(f"{PREFIX}/{namespace}/{peer}/{what}", msgpack.packb(obj, use_bin_type=True))


def get_blob(store: Store, namespace: str, peer: str, what: str, timeout: float) -> Any:
    try:
        data = store.get(f"{PREFIX}/{namespace}/{peer}/{what}", timeout=timeout)
    except StoreTimeout as e:
        raise CliError(f"peer {peer!r} did not publish its {what} within {timeout:.0f} s") from e
    return msgpack.unpackb(data, raw=False)


class Channel:
    """The writer's side of the commands: one reply per command, in order, per reader. Used from
    the writer's main thread only; a reader that fails, or says nothing within ``timeout``, is a
    CliError (``alive()`` is called while waiting, to notice dead local readers early). Keeps the
    readers' CPU seconds from their latest replies, for the CPU accounting."""

    def __init__(
        self, t: Transport, timeout: float = 300.0, alive: Callable[[], None] | None = None
    ) -> None:
        self.t, self.timeout, self.alive = t, timeout, alive
        self.cpu_s: dict[str, float] = {}
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
            if msg["cmd"] == "error":
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
        self, peers: Sequence[str], cmd: str, per_peer: Callable[[int], dict[str, Any]] | None = None,
        **fields: Any,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Send ``cmd`` to every peer (``per_peer(i)`` adds fields), then collect every reply."""
        for i, p in enumerate(peers):
            self.send(p, cmd, **fields, **(per_peer(i) if per_peer else {}))
        return [self.recv(p) for p in peers]


def serve(
    t: Transport, handlers: dict[str, Handler], progress: Callable[[], object], wait_s: float
) -> tuple[str, bool]:
    """The reader's loop: wait for a writer's commands, run each handler and send its reply,
    until "done". ``progress`` is called at least every 0.5 ms (raw NIXL targets need it).
    Returns the writer's name and whether it said it failed.

    Raises CliError when no writer turns up within ``wait_s`` or the writer goes away."""
    writer: str | None = None
    start = last_look = time.monotonic()
    while True:
        progress()
        try:
            n = t.wait_notification(timeout=0.0005)
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
        msg, writer = decode(n.payload), n.peer
        if msg["cmd"] == "done":
            t.notify(writer, encode("bye", cpu=time.process_time()))
            return writer, bool(msg.get("failed"))
        try:
            handler = handlers.get(msg["cmd"])
            if handler is None:
                raise CliError(
                    f"unknown bench command {msg['cmd']!r} (writer and reader of different versions?)"
                )
            reply = handler(msg)
        except Exception as e:
            with contextlib.suppress(Exception):
                why = f"{type(e).__name__}: {e}".splitlines()[0][:2000]
                t.notify(writer, encode("error", msg=why))
            raise
        t.notify(writer, encode(reply.pop("cmd", "ok"), cpu=time.process_time(), **reply))


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
                        f"reader {name!r} did not join namespace {t.namespace!r} within "
                        f"{timeout:.0f} s; start it with: transport bench ... --role reader "
                        f"--name {name} --store URL"
                    ) from None


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

    dirs = {m.__name__: os.path.dirname(os.path.abspath(m.__file__ or "")) for m in
            (transport, transport.backends)}  # fmt: skip
    return _BOOTSTRAP.format(tree=os.path.abspath(_tree.__file__), dirs=dirs)


class LocalReaders:
    """The reader child processes of a local run (``transport bench <cmd> --role reader``), one
    per name, each optionally pinned to a CPU. Each one's stderr goes to a temporary log, kept
    only when that reader failed: its last line explains the failure. :meth:`close` waits for
    them to exit (killing stragglers); :meth:`kill` ends them at once, after a failed run."""

    def __init__(self, command: Sequence[str], names: Sequence[str], store_url: str,
                 namespace: str, cpus: Sequence[int | None]) -> None:  # fmt: skip
        self.names = list(names)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = []
        for name, cpu in zip(names, cpus, strict=True):
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open until the reader is done
                prefix=f"{PREFIX}-{name}-", suffix=".log", delete=False
            )
            argv = [sys.executable, "-c", _reader_bootstrap(), "bench", *command, "--role",
                    "reader", "--store", store_url, "--name", name, "--namespace", namespace]  # fmt: skip
            argv += ["--cpu", str(cpu)] if cpu is not None else []
            self.logs.append(log)
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=log))  # fmt: skip

    def check(self) -> None:
        """CliError when a reader has exited with an error."""
        for p, name, log in zip(self.procs, self.names, self.logs, strict=True):
            if p.poll() not in (None, 0):
                try:
                    with open(log.name, errors="replace") as f:
                        last = ([ln.strip() for ln in f if ln.strip()] or ["(no output)"])[-1]
                except OSError:
                    last = "?"
                raise CliError(f"reader {name!r} exited with status {p.returncode}: {last} "
                               f"(log: {log.name})")  # fmt: skip

    def cpu_seconds(self) -> float:
        """CPU time the readers have used so far (from /proc; 0 where it cannot be read)."""
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def close(self, timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p, log in zip(self.procs, self.logs, strict=True):
            log.close()
            if p.returncode in (0, -9):
                with contextlib.suppress(OSError):
                    os.unlink(log.name)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.close(5.0)
