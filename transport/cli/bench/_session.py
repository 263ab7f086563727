"""The writer's session and the reader's main: what ``bench put`` and ``bench sync`` share
around their measurements (see _control for the protocol)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from transport.cli import CliError


@dataclass
class Session:
    """What :func:`writer_session` yields to a bench writer: its Transport ``t``, the command
    channel ``chan`` to the ``readers`` (already in the namespace), ``local`` (the reader child
    processes; None for the named peers of an existing store), the CPU affinity from before
    pinning (``saved_affinity``, restored for the baselines) and placement ``notes``.

    Valid only inside the ``with`` and used from the writer's main thread. Leaving it tells every
    reader done (failed or not), then closes the Transport, the local readers (killed after a
    failure) and the store.
    """

    t: Any
    chan: Any
    readers: list[str]
    local: Any
    saved_affinity: set[int] | None
    store_url: str
    notes: list[str]  # how the processes were placed, for the report

    def helper_cpu(self) -> float:
        """CPU seconds our readers on this host have used so far."""
        return self.local.cpu_seconds() if self.local else self.chan.cpu_here()

    def watch(self) -> Any:
        from transport.cli.bench._util import CpuWatch

        return CpuWatch(self.helper_cpu)


@contextmanager
def writer_session(args: argparse.Namespace, command: str, peers: list[str] | None,
                   n_readers: int, reader_args: list[str] | None = None) -> Iterator[Session]:  # fmt: skip
    """The writer's Transport, with its readers in the namespace: local child processes (no
    --store) or the named peers of an existing store."""
    import transport
    from transport.cli.bench._control import Channel, LocalReaders, wait_for_readers
    from transport.cli.bench._util import affinity, pin_layout, pin_to
    from transport.cli.peers import client_url
    from transport.lanes import default_lanes
    from transport.store import store_from_url
    from transport.store.tcp import TcpStore

    local = None
    alive: Callable[[], None] | None = None
    lanes = [int(x) for x in (getattr(args, "lanes", None) or "").split(",") if x.strip()]
    writer_cpus = max(lanes or [default_lanes()])
    pin, pin_note = pin_layout(args.pin, writer_cpus, n_readers if peers is None else 0)
    if peers is None:
        store: Any = TcpStore("127.0.0.1", 0, hosting="yes")
        names = [f"bench-reader-{i}" for i in range(n_readers)]
        ncpu = len(affinity() or {0})
        cpus = [(writer_cpus + i) % ncpu if pin else None for i in range(n_readers)]
        local = LocalReaders([command, *(reader_args or [])], names, client_url(store.url),
                             args.namespace, cpus)  # fmt: skip
        alive = local.check
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
        wait_for_readers(t, names, args.wait, alive)
        s = Session(t, Channel(t, timeout=args.timeout, alive=alive), names, local, saved,
                    getattr(store, "url", ""), [pin_note] if pin_note else [])  # fmt: skip
        yield s
        ok = True
    finally:
        if t is not None:
            for name in names:  # best effort: readers on other hosts exit now, not at their timeout
                with contextlib.suppress(Exception):  # a reader that is gone needs no goodbye
                    t.notify(name, _done(failed=not ok))
            if ok and local is None:
                for name in names:
                    with contextlib.suppress(CliError):
                        s.chan.recv(name, timeout=10)
            t.close()
        if local is not None:
            if ok:
                local.close()
            else:
                local.kill()
        store.close()


def _done(failed: bool) -> bytes:
    from transport.cli.bench._control import encode

    return encode("done", failed=failed)


def run_reader(args: argparse.Namespace, make: Callable[[Any, set[int] | None], Any]) -> int:
    import torch

    import transport
    from transport.cli.bench._control import linger, serve
    from transport.cli.bench._util import affinity, pin_to

    saved = affinity()
    torch.set_num_threads(1)  # helper ops need no pool; its threads would compete with the writer
    if args.cpu is not None:
        pin_to(args.cpu)
    with transport.Transport(args.name, store=args.store, namespace=args.namespace,
                             timeout=args.timeout) as t:  # fmt: skip
        reader = make(t, saved)
        print(
            f"transport bench: reader {t.name!r} joined namespace {t.namespace!r} of {args.store}; "
            "waiting for a writer",
            flush=True,
        )
        try:
            writer, failed = serve(t, reader.handlers(), reader.progress, args.wait)
        finally:
            reader.close()
        linger(t, writer)
    if failed:
        raise CliError(f"the writer {writer!r} failed; see its output")
    return 0


def nccl_unavailable(ready: list[dict[str, Any]], world: int, local: bool) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA here (NCCL broadcast needs a GPU in every process)"
    if any(not m.get("cuda") for m in ready):
        return "a reader has no CUDA device"
    if local and torch.cuda.device_count() < world:
        return (
            f"NCCL needs one GPU per process: {world} processes, {torch.cuda.device_count()} GPUs"
        )
    return None


def note_phase(res: Any, name: str, watch: Any) -> None:
    other = watch.busy_cpus()
    if other is None:
        return
    res.phases.append({"phase": name, "other_cpus": other})
    if other > 0.15:
        res.notes.append(
            f"BUSY MACHINE: other processes used {100 * other:.0f}% of a CPU during {name}; "
            "on a small machine that moves the ratios, rerun when it is quiet"
        )


def print_notes(res: Any, out: Any) -> None:
    if res.skipped:
        print("\nskipped:", file=out)
        for k, v in res.skipped.items():
            print(f"  {k}: {v}", file=out)
    if res.notes:
        print("\nnotes:", file=out)
        for n in res.notes:
            print(f"  {n}", file=out)


def write_outputs(args: argparse.Namespace, command: str, plan: Any, res: Any, ratios: Any,
                   env: dict[str, Any], total: float, plot: Callable[[str], None]) -> None:  # fmt: skip
    if args.json:
        doc = {
            "command": ["transport", *sys.argv[1:]],
            "config": asdict(plan), "environment": env, "records": res.records, "ratios": ratios,
            "skipped": res.skipped, "notes": res.notes, "phases": res.phases, "total_s": total,
        }  # fmt: skip
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.json)
    if args.plot:
        plot(args.plot)


class ReaderBase:
    """What every bench reader does alike: a raw NIXL agent beside our Transport (its progress,
    its metadata through the store), and a torch.distributed group for the baselines."""

    def __init__(self, t: Any, saved_affinity: set[int] | None) -> None:
        self.t, self.saved_affinity = t, saved_affinity
        self.agent: Any = None
        self.group: Any = None

    def progress(self) -> None:
        if self.agent is not None:
            self.agent.get_new_notifs()

    def setup_raw(self, tensors: list[Any], blob: dict[str, Any]) -> None:
        """Register ``tensors`` with a raw NIXL agent and publish its metadata plus ``blob``."""
        import transport.cli.bench._raw as _raw
        from transport.cli.bench._control import put_blob

        self.agent = _raw.new_agent(f"raw-{self.t.name}")
        self.agent.register_memory(tensors)
        put_blob(
            self.t.store,
            self.t.namespace,
            self.t.name,
            "raw",
            {"md": self.agent.get_agent_metadata(), **blob},
        )

    def ready(self) -> dict[str, Any]:
        import socket

        import torch

        return {"k": "ready", "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                "host": socket.gethostname()}  # fmt: skip

    def raw_md(self, m: dict[str, Any]) -> dict[str, Any]:
        from transport.cli.bench._control import get_blob

        self.agent.add_remote_agent(
            get_blob(self.t.store, self.t.namespace, m["writer"], "raw", 60)["md"]
        )
        return {}

    def open_group(self, m: dict[str, Any]) -> str:
        """Join the writer's torch.distributed group; returns the device its tensors live on."""
        from transport.cli.bench._dist import Group, reader_device
        from transport.cli.bench._util import unpin

        unpin(self.saved_affinity)  # gloo's threads: placed by the scheduler, as users run it
        device = reader_device(m["backend"], m["device"])
        self.group = Group(
            m["backend"], m["addr"], m["port"], m["rank"], m["world"], m["ks"], device
        )
        return device

    def close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        self.close_group()
