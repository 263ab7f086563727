"""How the writer and its readers talk, and the writer's side of a run (the reader's is
``_reader.py``). They meet in a store as Transport peers; the writer sends msgpack notifications
``{"cmd": ...}``, each answered by one reply (``"error"`` when the reader failed); larger blobs go
through the store under ``transport-bench/<namespace>/<peer>/<what>``. A local run hosts an
embedded store and starts the readers as child processes; ``--store URL --role ...`` runs the
same across hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from transport import (
    CliError,
    PeerWaitTimeout,
    StoreTimeout,
    TransferTimeout,
    Transport,
    WireFormatError,
)
from transport.cli.bench import _util

PREFIX = "transport-bench"
MAX_MESSAGE = 60 << 10


#: the notification of each write of ``bench put --notify``; readers pass over it
NOTE = b"bench-nt"


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


def put_blob(t: Transport, what: str, obj: Any) -> None:
    t.store.set(f"{PREFIX}/{t.namespace}/{t.name}/{what}", msgpack.packb(obj, use_bin_type=True))


def get_blob(t: Transport, peer: str, what: str, timeout: float = 60) -> Any:
    try:
        data = t.store.get(f"{PREFIX}/{t.namespace}/{peer}/{what}", timeout=timeout)
    except StoreTimeout as e:
        raise CliError(f"peer {peer!r} did not publish its {what} within {timeout:.0f} s") from e
    return msgpack.unpackb(data, raw=False)


def _poll(
    wait: Callable[[], Any], timeout: float, alive: Callable[[], None] | None, late: str
) -> Any:
    """``wait()`` again until it returns, calling ``alive()`` in between (it may raise): CliError
    ``late`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        with contextlib.suppress(TransferTimeout, PeerWaitTimeout):
            return wait()
        if alive is not None:
            alive()
        if time.monotonic() > end:
            raise CliError(late)


# -- the writer -----------------------------------------------------------------------------------

_BOOTSTRAP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_transport_tree", {tree!r})
tree = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tree)
tree.use_tree({dirs!r})
from transport.cli import main
sys.exit(main(sys.argv[1:]))
"""


class LocalReaders:
    """A local run's reader processes, optionally pinned, running the very ``transport`` this
    process imported; each one's stderr goes to a log that is kept only when it failed."""

    def __init__(
        self,
        command: Sequence[str],
        names: Sequence[str],
        store_url: str,
        namespace: str,
        cpus: Sequence[int | None],
    ) -> None:
        import transport.backends
        from transport.cli.bench import _tree

        here = lambda m: os.path.dirname(os.path.abspath(m.__file__ or ""))  # noqa: E731
        dirs = {m.__name__: here(m) for m in (transport, transport.backends)}
        code = _BOOTSTRAP.format(tree=os.path.abspath(_tree.__file__), dirs=dirs)
        self.procs: list[tuple[str, subprocess.Popen[bytes], str]] = []
        for name, cpu in zip(names, cpus, strict=True):
            fd, log = tempfile.mkstemp(prefix=f"{PREFIX}-{name}-", suffix=".log")
            argv = [
                sys.executable,
                "-c",
                code,
                "bench",
                *command,
                "--role",
                "reader",
                "--store",
                store_url,
                "--name",
                name,
                "--namespace",
                namespace,
            ]
            argv += ["--cpu", str(cpu)] if cpu is not None else []
            with os.fdopen(fd, "wb") as f:
                p = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f
                )
            self.procs.append((name, p, log))

    def check(self) -> None:
        """CliError, with the last line of its log, when a reader has exited with an error."""
        for name, p, log in self.procs:
            if p.poll() not in (None, 0):
                last = "?"
                with contextlib.suppress(OSError), open(log, errors="replace") as f:
                    last = ([ln.strip() for ln in f if ln.strip()] or ["(no output)"])[-1]
                raise CliError(
                    f"reader {name!r} exited with status {p.returncode}: {last} (log: {log})"
                )

    def cpu_seconds(self) -> float:
        """CPU time the readers have used so far (from /proc; 0 where it cannot be read)."""
        return sum(_util.process_cpu_seconds(p.pid) for _, p, _ in self.procs)

    def close(self, kill: bool = False) -> None:
        end = time.monotonic() + (5.0 if kill else 15.0)
        for _, p, log in self.procs:
            if kill and p.poll() is None:
                p.kill()
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.returncode in (0, -9):
                with contextlib.suppress(OSError):
                    os.unlink(log)


@dataclass
class Session:
    """The writer's side of a run (:func:`writer_session`): its Transport, the ``readers`` in the
    namespace (``local`` processes or peers of a store), the affinity before pinning, placement
    ``notes`` and the replies to "setup" (``ready``). Commands get one reply each, in order; a
    reader that fails or is silent for ``timeout`` is a CliError. Writer's main thread only."""

    t: Transport
    readers: list[str]
    local: LocalReaders | None
    saved_affinity: set[int] | None
    notes: list[str]
    wait: float
    timeout: float
    ready: list[dict[str, Any]] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)

    def send(self, peer: str, cmd: str, **fields: Any) -> None:
        self.t.notify(peer, encode(cmd, **fields))

    def recv(self, peer: str, timeout: float | None = None) -> dict[str, Any]:
        limit = self.timeout if timeout is None else timeout
        n = _poll(
            lambda: self.t.wait_notification(timeout=0.25, peer=peer),
            limit,
            self.local.check if self.local else None,
            f"reader {peer!r} did not answer within {limit:.0f} s",
        )
        if (msg := decode(n.payload))["cmd"] == "error":
            raise CliError(f"reader {peer!r} failed: {msg.get('msg', '?')}")
        if isinstance(msg.get("cpu"), float):
            self.cpu_s[peer] = msg["cpu"]
        if isinstance(msg.get("host"), str):
            self.hosts[peer] = msg["host"]
        return msg

    def ask(
        self,
        peers: Sequence[str],
        cmd: str,
        per_peer: Callable[[int], dict[str, Any]] | None = None,
        **fields: Any,
    ) -> list[dict[str, Any]]:
        """Send ``cmd`` to every peer (``per_peer(i)`` adds fields), then collect every reply."""
        for i, p in enumerate(peers):
            self.send(p, cmd, **fields, **(per_peer(i) if per_peer else {}))
        return [self.recv(p) for p in peers]

    def watch(self) -> Callable[[], float | None]:
        """CPU use of other processes from now on (our readers on this host left out)."""
        here = socket.gethostname()
        mine = lambda: sum(v for p, v in self.cpu_s.items() if self.hosts.get(p) == here)  # noqa: E731
        return _util.cpu_watch(self.local.cpu_seconds if self.local else mine)

    def nccl_unavailable(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA here (NCCL broadcast needs a GPU in every process)"
        if any(not m.get("cuda") for m in self.ready):
            return "a reader has no CUDA device"
        world, ngpu = len(self.readers) + 1, torch.cuda.device_count()
        if self.local is not None and ngpu < world:
            return f"NCCL needs one GPU per process: {world} processes, {ngpu} GPUs"
        return None

    def device_of(self, rank: int) -> int:
        """The CUDA device of ``rank`` (NCCL): one each on this host, the first elsewhere."""
        local = self.local is not None and torch.cuda.is_available()
        return rank % torch.cuda.device_count() if local else 0


def bench_secret(args: argparse.Namespace, local: bool) -> str | None:
    """The secret of a ``--secret`` run: $TRANSPORT_SECRET, or for a local run a random one that
    its readers inherit through the environment (never on a command line)."""
    if not args.secret:
        return None
    secret = os.environ.get("TRANSPORT_SECRET", "")
    if not secret and local:
        secret = os.environ["TRANSPORT_SECRET"] = os.urandom(16).hex()
    if len(secret) < 8:
        raise CliError(
            "--secret reads the secret from $TRANSPORT_SECRET (at least 8 characters, the same "
            "on every host of the run); set it, or run all on one host"
        )
    return secret


@contextmanager
def writer_session(
    args: argparse.Namespace, command: list[str], n_readers: int, peers: list[str] | None
) -> Iterator[Session]:
    """The writer's session with local readers (``transport bench *command``) or the ``peers`` of
    a store. Leaving tells every reader done, then closes all (local readers killed on failure)."""
    from transport import store_from_url
    from transport.cli.bench import names
    from transport.cli.peers import client_url
    from transport.store.tcp import TcpStore
    from transport.transfers.lanes import default_lanes

    writer_cpus = max([int(x) for x in names(getattr(args, "lanes", None))] or [default_lanes()])
    pin, pin_note = _util.pin_layout(args.pin, writer_cpus, n_readers if peers is None else 0)
    local, saved, t, ok = None, _util.affinity(), None, False
    secret = bench_secret(args, local=peers is None)
    command = [*command, "--secret"] if secret else command
    if peers is None:
        store: Any = TcpStore("127.0.0.1", 0, hosting="yes")
        readers = [f"bench-reader-{i}" for i in range(n_readers)]
        cpus = [(writer_cpus + i) % len(saved or {0}) if pin else None for i in range(n_readers)]
        local = LocalReaders(command, readers, client_url(store.url), args.namespace, cpus)
    else:
        store, readers = store_from_url(client_url(args.store)), peers
    try:
        if pin:
            _util.pin_to(0, writer_cpus)  # the engine threads (one per lane) and NIXL's inherit it
        t = Transport(
            args.name or "bench-writer",
            store=store,
            namespace=args.namespace,
            timeout=args.timeout,
            secret=secret,
        )
        end = time.monotonic() + args.wait
        for name in readers:
            late = (
                f"reader {name!r} did not join namespace {args.namespace!r} within "
                f"{args.wait:.0f} s; start it with: transport bench ... --role reader --name "
                f"{name} --store URL"
            )
            wait = lambda n=name: t.wait_for_peer(n, timeout=0.5)  # type: ignore[union-attr]  # noqa: E731
            _poll(wait, end - time.monotonic(), local.check if local else None, late)
        s = Session(
            t, readers, local, saved, [pin_note] if pin_note else [], args.wait, args.timeout
        )
        yield s
        ok = True
    finally:
        # best effort: readers on other hosts exit now, not at their timeout; one that is gone
        # needs no goodbye
        for name in readers if t is not None else []:
            with contextlib.suppress(Exception):
                t.notify(name, encode("done", failed=not ok))  # type: ignore[union-attr]
        if t is not None:
            if ok and local is None:
                for name in readers:
                    with contextlib.suppress(CliError):
                        s.recv(name, timeout=10)
            t.close()
        if local is not None:
            local.close(kill=not ok)
        store.close()
