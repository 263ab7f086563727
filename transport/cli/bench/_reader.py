"""A bench reader's side of a run: it joins the writer's namespace, exposes what its workload
says, and serves the writer's commands (``_session.py``: the messages and the writer's side) until
the writer says done. Raw NIXL, the collectives and Mooncake run here on the reader's end.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

from transport import CliError, PeerWaitTimeout, StoreError, TransferTimeout, Transport
from transport.cli.bench import _mooncake, _util
from transport.cli.bench._runner import Workload
from transport.cli.bench._session import NOTE, bench_secret, decode, encode, get_blob, put_blob
from transport.cli.bench._systems import Group, device_for, new_agent


def _present(t: Transport, name: str) -> bool:
    """Whether ``name`` has a record: its own, not every peer's (the records of peers that
    expose 100,000 regions cost a reader seconds to decode)."""
    try:
        t.wait_for_peer(name, timeout=0)
    except PeerWaitTimeout:
        return False
    return True


@dataclass
class Reader:
    """A reader: serves the writer's commands (``on_<cmd>``) over what its workload exposes
    (``mine``; ``dist``: copies for the collectives), with a raw NIXL agent and a process group
    when those run. Single-threaded: :meth:`serve` makes raw NIXL progress every 0.5 ms."""

    t: Transport
    w: Workload
    saved: set[int] | None
    mine: list[torch.Tensor] = field(default_factory=list)
    dist: list[torch.Tensor] = field(default_factory=list)
    agent: Any = None
    group: Group | None = None
    store_url: str = ""
    mooncake: Any = None
    torch_api: Any = None

    def serve(self, wait_s: float) -> tuple[str, bool]:
        """Run the writer's commands until "done"; the writer's name and whether it failed.
        CliError when no writer turns up within ``wait_s`` or the writer goes away."""
        t, writer = self.t, None
        start = last_look = time.monotonic()
        while True:
            if self.agent is not None:
                self.agent.get_new_notifs()
            if self.mooncake is not None:
                self.mooncake.drain()
            try:
                n = t.wait_notification(timeout=0.0005)
            except TransferTimeout:
                if (now := time.monotonic()) - last_look > 2.0:
                    last_look = now
                    if writer is None and now - start > wait_s:
                        late = f"no writer contacted reader {t.name!r} within {wait_s:.0f} s"
                        raise CliError(late) from None
                    if writer is not None and not _present(t, writer):
                        raise CliError(f"the writer {writer!r} went away") from None
                continue
            if (writer is not None and n.peer != writer) or n.payload == NOTE:
                continue  # not a command: another writer's, or one that came with data
            msg, writer = decode(n.payload), n.peer
            if msg["cmd"] == "done":
                t.notify(writer, encode("bye", cpu=time.process_time()))
                return writer, bool(msg.get("failed"))
            try:
                if (handler := getattr(self, "on_" + msg["cmd"].replace("-", "_"), None)) is None:
                    raise CliError(
                        f"unknown bench command {msg['cmd']!r} (writer and reader of "
                        "different versions?)"
                    )
                reply = handler(msg)
            except Exception as e:
                with contextlib.suppress(Exception):
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:2000]
                    t.notify(writer, encode("error", msg=why))
                raise
            t.notify(writer, encode(reply.pop("cmd", "ok"), cpu=time.process_time(), **reply))

    def tensors(self, m: dict[str, Any]) -> list[torch.Tensor]:
        return self.w.select(m["spec"], self.dist if m["dist"] and self.dist else self.mine)

    def on_setup(self, m: dict[str, Any]) -> dict[str, Any]:
        self.mine, addrs = self.w.expose(self.t, m)
        if m["raw"]:
            self.agent = new_agent(f"raw-{self.t.name}")
            self.agent.register_memory(self.mine)
            put_blob(self.t, "raw", {"md": self.agent.get_agent_metadata(), **addrs})
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"cmd": "ready", "cuda": cuda, "host": socket.gethostname()}

    def on_idle(self, m: dict[str, Any]) -> dict[str, Any]:
        """This process's CPU over ``s`` seconds in which it makes no call: what an idle
        receiver's engine (and NIXL's progress thread, if on) cost."""
        from transport.backends.nixl import progress_mode

        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(float(m["s"]))
        idle = (time.process_time() - c0) / (time.monotonic() - t0)
        return {"idle": idle, "progress": progress_mode(None)}

    def on_mooncake(self, m: dict[str, Any]) -> dict[str, Any]:
        """Start Mooncake's engine over this reader's memory; its session and ``buf``'s address."""
        self.mooncake = _mooncake.MooncakeEngine(
            _mooncake.address_toward(urlsplit(self.store_url).hostname), self.mine
        )
        return {
            "session": self.mooncake.session,
            "address": self.mooncake.address,
            "buf": self.mine[0].data_ptr(),
        }

    def on_torch_api(self, m: dict[str, Any]) -> dict[str, Any]:
        """Endpoints of torch's transport API over ``buf``: their URLs and descriptors go to the
        store (the writer's blob ``torch-api``, once published, connects them back)."""
        from transport.cli.bench._torch_api import Endpoints

        self.torch_api = Endpoints(self.mine[0])
        put_blob(
            self.t,
            "torch-api",
            {"urls": self.torch_api.urls(), "remote": self.torch_api.descriptors()},
        )
        return {}

    def on_torch_api_connect(self, m: dict[str, Any]) -> dict[str, Any]:
        self.torch_api.connect(get_blob(self.t, m["writer"], "torch-api")["urls"])
        return {}

    def on_raw_md(self, m: dict[str, Any]) -> dict[str, Any]:
        self.agent.add_remote_agent(get_blob(self.t, m["writer"], "raw")["md"])
        return {}

    def on_zero(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.zero_all(self.tensors(m))
        return {}

    def on_fill(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.fill_all(self.tensors(m), m["seed"])
        return {}

    def on_check(self, m: dict[str, Any]) -> dict[str, Any]:
        return self.w.check(m["spec"], m["seed"], self.tensors(m))

    def on_dist_init(self, m: dict[str, Any]) -> dict[str, Any]:
        _util.unpin(self.saved)  # gloo's threads: placed by the scheduler, as users run it
        device = device_for(m["backend"], m["device"])
        self.group = Group(m, device)
        copy = (lambda x: x) if device == "cpu" else (lambda x: torch.zeros_like(x, device=device))
        self.dist = [_util.as_bytes(copy(x)) for x in self.mine]
        return {}

    def on_dist_run(self, m: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None
        for _ in range(m["count"]):
            self.group.read(m["mode"], self.tensors({**m, "dist": True}), m["recv"])
        return {}

    def on_dist_end(self, m: dict[str, Any]) -> dict[str, Any]:
        if self.group is not None:
            self.group.close()
        self.group, self.dist = None, []
        return {}


def run_reader(args: argparse.Namespace, w: Workload) -> int:
    """A reader's main: join the namespace, serve one writer until it says done, then stay until
    the writer has left (this process may host the store it uses)."""
    saved = _util.affinity()
    torch.set_num_threads(1)  # helper ops need no pool; its threads would compete with the writer
    _util.pin_to(args.cpu)
    w.prepare_reader()
    with Transport(
        args.name,
        store=args.store,
        namespace=args.namespace,
        timeout=args.timeout,
        secret=bench_secret(args, local=False),
    ) as t:
        reader = Reader(t, w, saved, store_url=args.store)
        w.open_reader(t)
        print(
            f"transport bench: reader {t.name!r} joined namespace {t.namespace!r} of "
            f"{args.store}; waiting for a writer",
            flush=True,
        )
        try:
            writer, failed = reader.serve(args.wait)
        finally:
            reader.on_dist_end({})
            if reader.torch_api is not None:
                reader.torch_api.close()
            w.close()
        end = time.monotonic() + 10.0
        with contextlib.suppress(StoreError):
            while time.monotonic() < end and writer in {p.name for p in t.peers()}:
                time.sleep(0.05)
    if failed:
        raise CliError(f"the writer {writer!r} failed; see its output")
    return 0
