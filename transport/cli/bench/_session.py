"""Both sides of a bench run's processes: the writer's session (its Transport, its readers in the
namespace, pinning) and the reader's main (one command table for every workload; see _control
for the protocol)."""

from __future__ import annotations

import argparse
import contextlib
import socket
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import transport
from transport.cli import CliError
from transport.cli.bench import _control, _raw, _util
from transport.cli.bench._control import Channel, LocalReaders, encode, serve
from transport.cli.bench._dist import Group, device_for
from transport.cli.bench._util import CpuWatch, affinity, pin_layout, pin_to, unpin


@dataclass
class Session:
    """What :func:`writer_session` yields to the runner: the writer's Transport ``t``, the command
    channel ``chan`` to the ``readers`` (already in the namespace), ``local`` (the reader child
    processes; None for the named peers of an existing store), the CPU affinity from before
    pinning (``saved_affinity``, restored for the baselines), placement ``notes``, how long to
    ``wait`` for the other side, and the
    readers' replies to "setup" (``ready``: their CUDA devices).

    Valid only inside the ``with`` and used from the writer's main thread. Leaving it tells every
    reader done (failed or not), then closes the Transport, the local readers (killed after a
    failure) and the store.
    """

    t: transport.Transport
    chan: Channel
    readers: list[str]
    local: LocalReaders | None
    saved_affinity: set[int] | None
    notes: list[str]
    wait: float
    ready: list[dict[str, Any]] = field(default_factory=list)

    def watch(self) -> CpuWatch:
        """CPU use of other processes from now on (our readers on this host left out)."""
        return CpuWatch(self.local.cpu_seconds if self.local else self.chan.cpu_here)

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


@contextmanager
def writer_session(args: argparse.Namespace, command: list[str], n_readers: int,
                   peers: list[str] | None) -> Iterator[Session]:  # fmt: skip
    """The writer's Transport, with its readers in the namespace: local child processes running
    ``transport bench *command`` (no --store) or the named peers of an existing store."""
    from transport.cli.peers import client_url
    from transport.lanes import default_lanes
    from transport.store import store_from_url
    from transport.store.tcp import TcpStore

    local = None
    lanes = [int(x) for x in (getattr(args, "lanes", None) or "").split(",") if x.strip()]
    writer_cpus = max(lanes or [default_lanes()])
    pin, pin_note = pin_layout(args.pin, writer_cpus, n_readers if peers is None else 0)
    if peers is None:
        store: Any = TcpStore("127.0.0.1", 0, hosting="yes")
        names = [f"bench-reader-{i}" for i in range(n_readers)]
        ncpu = len(affinity() or {0})
        cpus = [(writer_cpus + i) % ncpu if pin else None for i in range(n_readers)]
        local = LocalReaders(command, names, client_url(store.url), args.namespace, cpus)
    else:
        store = store_from_url(client_url(args.store))
        names = peers
    saved = affinity()
    t = None
    ok = False
    try:
        if pin:
            pin_to(0, writer_cpus)  # the engine threads (one per lane) and NIXL's inherit it
        t = transport.Transport(args.name or "bench-writer", store=store, namespace=args.namespace,
                                timeout=args.timeout)  # fmt: skip
        alive = local.check if local else None
        _control.wait_for_readers(t, names, args.wait, alive)
        chan = Channel(t, timeout=args.timeout, alive=alive)
        yield Session(t, chan, names, local, saved, [pin_note] if pin_note else [], args.wait)
        ok = True
    finally:
        if t is not None:
            for name in names:  # best effort: readers on other hosts exit now, not at their timeout
                with contextlib.suppress(Exception):  # a reader that is gone needs no goodbye
                    t.notify(name, encode("done", failed=not ok))
            if ok and local is None:
                for name in names:
                    with contextlib.suppress(CliError):
                        chan.recv(name, timeout=10)
            t.close()
        if local is not None:
            local.close() if ok else local.kill()
        store.close()


class Buffers(ABC):
    """A reader's memory for one workload: what it exposes and registers, and which of its tensors
    a command's ``spec`` names. Owned by the :class:`Reader` that serves the writer; lives until
    the reader closes it, after the writer said done."""

    @abstractmethod
    def setup(self, t: transport.Transport, m: dict[str, Any]) -> tuple[list[torch.Tensor], dict]:
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
        xs = self.tensors(spec, dist)
        return {"ok": all(_util.check_pattern(x, seed + j) for j, x in enumerate(xs))}

    def close(self) -> None:  # noqa: B027 - a hook
        """Release what :meth:`setup` took."""


class Reader:
    """A bench reader: serves the writer's commands over its ``buffers`` (setup, raw-md, zero,
    fill, check, dist-init, dist-run, dist-end), with a raw NIXL agent beside our Transport when
    raw NIXL is measured (made progress on every 0.5 ms) and a torch.distributed group while a
    baseline runs. Single-threaded: everything happens in :func:`serve`'s loop."""

    def __init__(self, t: transport.Transport, buffers: Buffers, saved: set[int] | None) -> None:
        self.t, self.buffers, self.saved = t, buffers, saved
        self.agent: Any = None
        self.group: Group | None = None

    def handlers(self) -> dict[str, Any]:
        return {"setup": self.setup, "raw-md": self.raw_md, "zero": self.zero, "fill": self.fill,
                "check": self.check, "dist-init": self.dist_init, "dist-run": self.dist_run,
                "dist-end": self.dist_end}  # fmt: skip

    def progress(self) -> None:
        if self.agent is not None:
            self.agent.get_new_notifs()

    def setup(self, m: dict[str, Any]) -> dict[str, Any]:
        tensors, addrs = self.buffers.setup(self.t, m)
        if m["raw"]:
            self.agent = _raw.new_agent(f"raw-{self.t.name}")
            self.agent.register_memory(tensors)
            blob = {"md": self.agent.get_agent_metadata(), **addrs}
            _control.put_blob(self.t.store, self.t.namespace, self.t.name, "raw", blob)
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"cmd": "ready", "cuda": cuda, "host": socket.gethostname()}

    def raw_md(self, m: dict[str, Any]) -> dict[str, Any]:
        blob = _control.get_blob(self.t.store, self.t.namespace, m["writer"], "raw", 60)
        self.agent.add_remote_agent(blob["md"])
        return {}

    def zero(self, m: dict[str, Any]) -> dict[str, Any]:
        for x in self.buffers.tensors(m["spec"], m["dist"]):
            _util.zero_bytes(x)
        return {}

    def fill(self, m: dict[str, Any]) -> dict[str, Any]:
        for j, x in enumerate(self.buffers.tensors(m["spec"], m["dist"])):
            _util.fill_pattern(x, m["seed"] + j)
        return {}

    def check(self, m: dict[str, Any]) -> dict[str, Any]:
        return self.buffers.check(m["spec"], m["seed"], m["dist"])

    def dist_init(self, m: dict[str, Any]) -> dict[str, Any]:
        unpin(self.saved)  # gloo's threads: placed by the scheduler, as users run it
        device = device_for(m["backend"], m["device"])
        self.group = Group(m["backend"], m["addr"], m["port"], m["rank"], m["world"], m["ks"],
                           device)  # fmt: skip
        self.buffers.open_dist(device)
        return {}

    def dist_run(self, m: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None
        xs = self.buffers.tensors(m["spec"], True)
        for _ in range(m["count"]):
            self.group.read(m["mode"], xs, m["recv"])
        return {}

    def dist_end(self, m: dict[str, Any]) -> dict[str, Any]:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.buffers.close_dist()
        return {}

    def close(self) -> None:
        self.dist_end({})
        self.buffers.close()


def run_reader(args: argparse.Namespace, buffers: Any) -> int:
    """A reader's main: join the namespace, serve one writer until it says done, linger until it
    has left. ``buffers(t)`` makes the workload's :class:`Buffers`."""
    saved = affinity()
    torch.set_num_threads(1)  # helper ops need no pool; its threads would compete with the writer
    if args.cpu is not None:
        pin_to(args.cpu)
    with transport.Transport(args.name, store=args.store, namespace=args.namespace,
                             timeout=args.timeout) as t:  # fmt: skip
        reader = Reader(t, buffers(t), saved)
        print(f"transport bench: reader {t.name!r} joined namespace {t.namespace!r} of "
              f"{args.store}; waiting for a writer", flush=True)  # fmt: skip
        try:
            writer, failed = serve(t, reader.handlers(), reader.progress, args.wait)
        finally:
            reader.close()
        _control.linger(t, writer)
    if failed:
        raise CliError(f"the writer {writer!r} failed; see its output")
    return 0
