"""Both sides of a bench run's processes and how they talk.

Every run is one *writer* (it measures) and one or more *readers* (they expose memory and serve).
They meet in a store and a namespace as ordinary Transport peers, and the writer drives the
readers with small commands: msgpack notifications ``{"cmd": name, ...}`` over the Transport
itself, each answered by one reply (``{"cmd": "error", "msg": ...}`` when the reader failed).
Larger blobs (raw NIXL agent metadata, addresses of a thousand tensors) go through the store
under ``transport-bench/<namespace>/<peer>/<what>``.

By default the writer is the ``transport bench ...`` process itself: it hosts an embedded store
on a free port and starts the readers as child processes (``--role reader``). With ``--store URL
--role writer|reader`` the same code runs on different hosts.
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

import transport
from transport import PeerWaitTimeout, TransferTimeout, Transport
from transport.cli import CliError
from transport.cli.bench import _raw, _util
from transport.cli.bench._systems import Group, device_for
from transport.errors import StoreError, StoreTimeout, WireFormatError
from transport.store import Store

PREFIX = "transport-bench"
MAX_MESSAGE = 60 << 10


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


@dataclass
class Channel:
    """The writer's side of the commands: one reply per command, in order, per reader. Used from
    the writer's main thread only; a reader that fails, or says nothing within ``timeout``, is a
    CliError (``alive()`` is called while waiting, to notice dead local readers early). Keeps the
    readers' CPU seconds and hosts from their latest replies, for the CPU accounting."""

    t: Transport
    timeout: float = 300.0
    alive: Callable[[], None] | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)

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
            if (msg := decode(n.payload))["cmd"] == "error":
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

    def ask(self, peers: Sequence[str], cmd: str, per_peer: Callable[[int], dict[str, Any]] | None = None,
            **fields: Any) -> list[dict[str, Any]]:  # fmt: skip
        """Send ``cmd`` to every peer (``per_peer(i)`` adds fields), then collect every reply."""
        for i, p in enumerate(peers):
            self.send(p, cmd, **fields, **(per_peer(i) if per_peer else {}))
        return [self.recv(p) for p in peers]


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
    """The reader child processes of a local run (``transport bench <cmd> --role reader``), one
    per name, each optionally pinned to a CPU, running ``transport`` from the very directories
    this process imported it from (the readers must measure the writer's code). Each one's stderr
    goes to a temporary log, kept only when that reader failed. :meth:`close` waits for them to
    exit (killing stragglers, at once with ``kill``)."""

    def __init__(self, command: Sequence[str], names: Sequence[str], store_url: str,
                 namespace: str, cpus: Sequence[int | None]) -> None:  # fmt: skip
        import transport.backends
        from transport.cli.bench import _tree

        dirs = {m.__name__: os.path.dirname(os.path.abspath(m.__file__ or ""))
                for m in (transport, transport.backends)}  # fmt: skip
        code = _BOOTSTRAP.format(tree=os.path.abspath(_tree.__file__), dirs=dirs)
        self.names, self.procs, self.logs = list(names), [], []
        for name, cpu in zip(names, cpus, strict=True):
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - open until the reader is done
                prefix=f"{PREFIX}-{name}-", suffix=".log", delete=False
            )
            argv = [sys.executable, "-c", code, "bench", *command, "--role", "reader", "--store",
                    store_url, "--name", name, "--namespace", namespace]  # fmt: skip
            argv += ["--cpu", str(cpu)] if cpu is not None else []
            self.logs.append(log)
            self.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL, stderr=log))  # fmt: skip

    def check(self) -> None:
        """CliError, with the last line of its log, when a reader has exited with an error."""
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

    def close(self, kill: bool = False) -> None:
        end = time.monotonic() + (5.0 if kill else 15.0)
        for p in self.procs:
            if kill and p.poll() is None:
                p.kill()
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


@dataclass
class Session:
    """What :func:`writer_session` yields to the runner: the writer's Transport ``t``, the command
    channel ``chan`` to the ``readers`` (already in the namespace), ``local`` (the reader child
    processes; None for the named peers of an existing store), the CPU affinity from before
    pinning (``saved_affinity``, restored for the baselines), placement ``notes``, how long to
    ``wait`` for the other side, and the readers' replies to "setup" (``ready``). Valid only
    inside the ``with``, on the writer's main thread."""

    t: transport.Transport
    chan: Channel
    readers: list[str]
    local: LocalReaders | None
    saved_affinity: set[int] | None
    notes: list[str]
    wait: float
    ready: list[dict[str, Any]] = field(default_factory=list)

    def watch(self) -> Callable[[], float | None]:
        """CPU use of other processes from now on (our readers on this host left out)."""
        return _util.cpu_watch(self.local.cpu_seconds if self.local else self.chan.cpu_here)

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


def _wait_for_readers(t: Transport, names: Sequence[str], timeout: float, alive: Any) -> None:
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


@contextmanager
def writer_session(args: argparse.Namespace, command: list[str], n_readers: int,
                   peers: list[str] | None) -> Iterator[Session]:  # fmt: skip
    """The writer's Transport, with its readers in the namespace: local child processes running
    ``transport bench *command`` (no --store) or the named peers of an existing store. Leaving
    tells every reader done (failed or not), then closes the Transport, the local readers
    (killed after a failure) and the store."""
    from transport.cli.bench import names
    from transport.cli.peers import client_url
    from transport.lanes import default_lanes
    from transport.store import store_from_url
    from transport.store.tcp import TcpStore

    local = None
    writer_cpus = max([int(x) for x in names(getattr(args, "lanes", None))] or [default_lanes()])
    pin, pin_note = _util.pin_layout(args.pin, writer_cpus, n_readers if peers is None else 0)
    store: Store
    if peers is None:
        store = TcpStore("127.0.0.1", 0, hosting="yes")
        readers = [f"bench-reader-{i}" for i in range(n_readers)]
        ncpu = len(_util.affinity() or {0})
        cpus = [(writer_cpus + i) % ncpu if pin else None for i in range(n_readers)]
        local = LocalReaders(command, readers, client_url(store.url), args.namespace, cpus)
    else:
        store, readers = store_from_url(client_url(args.store)), peers
    saved, t, ok = _util.affinity(), None, False
    try:
        if pin:
            _util.pin_to(0, writer_cpus)  # the engine threads (one per lane) and NIXL's inherit it
        t = transport.Transport(args.name or "bench-writer", store=store, namespace=args.namespace,
                                timeout=args.timeout)  # fmt: skip
        alive = local.check if local else None
        _wait_for_readers(t, readers, args.wait, alive)
        chan = Channel(t, timeout=args.timeout, alive=alive)
        yield Session(t, chan, readers, local, saved, [pin_note] if pin_note else [], args.wait)
        ok = True
    finally:
        if t is not None:
            for (
                name
            ) in readers:  # best effort: readers on other hosts exit now, not at their timeout
                with contextlib.suppress(Exception):  # a reader that is gone needs no goodbye
                    t.notify(name, encode("done", failed=not ok))
            if ok and local is None:
                for name in readers:
                    with contextlib.suppress(CliError):
                        chan.recv(name, timeout=10)
            t.close()
        if local is not None:
            local.close(kill=not ok)
        store.close()


# -- the reader -----------------------------------------------------------------------------------


class Buffers(ABC):
    """A reader's memory for one workload: what it exposes and registers, and which of its tensors
    a command's ``spec`` names. Owned by the :class:`Reader`; lives until the writer said done."""

    @abstractmethod
    def setup(self, t: Transport, m: dict[str, Any]) -> tuple[list[torch.Tensor], dict]:
        """Allocate and expose (``m``: the writer's "setup"); returns the tensors raw NIXL
        registers and their addresses for the writer."""

    @abstractmethod
    def tensors(self, spec: dict[str, Any], dist: bool) -> list[torch.Tensor]:
        """The tensors ``spec`` names: the exposed ones, or (``dist``) the collectives' copies."""

    def open_dist(self, device: str) -> None:  # noqa: B027 - a hook
        """Make the collectives' copies on ``device`` (cpu: the exposed tensors serve)."""

    def close_dist(self) -> None:  # noqa: B027 - a hook
        """Drop the copies of :meth:`open_dist`."""

    def check(self, spec: dict[str, Any], seed: int, dist: bool) -> dict[str, Any]:
        return {"ok": _util.check_all(self.tensors(spec, dist), seed)}

    def close(self) -> None:  # noqa: B027 - a hook
        """Release what :meth:`setup` took."""


@dataclass
class Reader:
    """A bench reader: serves the writer's commands (its ``on_<cmd>`` methods) over its
    ``buffers``, with a raw NIXL agent beside our Transport when raw NIXL is measured and a
    torch.distributed group while a baseline runs. Single-threaded: everything happens in
    :meth:`serve`'s loop, which makes raw NIXL progress every 0.5 ms (raw targets need it)."""

    t: Transport
    buffers: Buffers
    saved: set[int] | None
    agent: Any = None
    group: Group | None = None

    def serve(self, wait_s: float) -> tuple[str, bool]:
        """Run the writer's commands until "done"; the writer's name and whether it failed.
        CliError when no writer turns up within ``wait_s`` or the writer goes away."""
        t, writer = self.t, None
        start = last_look = time.monotonic()
        while True:
            if self.agent is not None:
                self.agent.get_new_notifs()
            try:
                n = t.wait_notification(timeout=0.0005)
            except TransferTimeout:
                if (now := time.monotonic()) - last_look > 2.0:
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
                if (handler := getattr(self, "on_" + msg["cmd"].replace("-", "_"), None)) is None:
                    raise CliError(f"unknown bench command {msg['cmd']!r} (writer and reader of "
                                   "different versions?)")  # fmt: skip
                reply = handler(msg)
            except Exception as e:
                with contextlib.suppress(Exception):
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:2000]
                    t.notify(writer, encode("error", msg=why))
                raise
            t.notify(writer, encode(reply.pop("cmd", "ok"), cpu=time.process_time(), **reply))

    def on_setup(self, m: dict[str, Any]) -> dict[str, Any]:
        tensors, addrs = self.buffers.setup(self.t, m)
        if m["raw"]:
            self.agent = _raw.new_agent(f"raw-{self.t.name}")
            self.agent.register_memory(tensors)
            put_blob(self.t, "raw", {"md": self.agent.get_agent_metadata(), **addrs})
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"cmd": "ready", "cuda": cuda, "host": socket.gethostname()}

    def on_raw_md(self, m: dict[str, Any]) -> dict[str, Any]:
        self.agent.add_remote_agent(get_blob(self.t, m["writer"], "raw")["md"])
        return {}

    def on_zero(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.zero_all(self.buffers.tensors(m["spec"], m["dist"]))
        return {}

    def on_fill(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.fill_all(self.buffers.tensors(m["spec"], m["dist"]), m["seed"])
        return {}

    def on_check(self, m: dict[str, Any]) -> dict[str, Any]:
        return self.buffers.check(m["spec"], m["seed"], m["dist"])

    def on_dist_init(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.unpin(self.saved)  # gloo's threads: placed by the scheduler, as users run it
        device = device_for(m["backend"], m["device"])
        self.group = Group(
            m["backend"], m["addr"], m["port"], m["rank"], m["world"], m["ks"], device
        )
        self.buffers.open_dist(device)
        return {}

    def on_dist_run(self, m: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None
        xs = self.buffers.tensors(m["spec"], True)
        for _ in range(m["count"]):
            self.group.read(m["mode"], xs, m["recv"])
        return {}

    def on_dist_end(self, m: dict[str, Any]) -> dict[str, Any]:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.buffers.close_dist()
        return {}


def run_reader(args: argparse.Namespace, buffers: Callable[[Transport], Buffers]) -> int:
    """A reader's main: join the namespace, serve one writer until it says done, then stay until
    the writer has left (this process may host the store it uses)."""
    saved = _util.affinity()
    torch.set_num_threads(1)  # helper ops need no pool; its threads would compete with the writer
    _util.pin_to(args.cpu)
    with transport.Transport(args.name, store=args.store, namespace=args.namespace,
                             timeout=args.timeout) as t:  # fmt: skip
        reader = Reader(t, buffers(t), saved)
        print(f"transport bench: reader {t.name!r} joined namespace {t.namespace!r} of "
              f"{args.store}; waiting for a writer", flush=True)  # fmt: skip
        try:
            writer, failed = reader.serve(args.wait)
        finally:
            reader.on_dist_end({})
            reader.buffers.close()
        end = time.monotonic() + 10.0
        with contextlib.suppress(StoreError):
            while time.monotonic() < end and writer in {p.name for p in t.peers()}:
                time.sleep(0.05)
    if failed:
        raise CliError(f"the writer {writer!r} failed; see its output")
    return 0
