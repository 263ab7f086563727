"""The System contract and the systems both bench commands share: ours (a transfer through our
Transport), raw NIXL, gloo and NCCL (one class over torch.distributed) and memcpy.

A workload builds a configuration's systems; the runner (``_runner``) sets them up, times them,
verifies each once and closes them. ``bench sync`` adds one system of its own (the publisher).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch

from transport.cli.bench._util import check_all, fill_all, zero_all

if TYPE_CHECKING:
    from transport.cli.bench._raw import RawPath
    from transport.cli.bench._session import Session


class System(ABC):
    """One way of moving one configuration's bytes: the contract every measured system keeps.

    Built by a workload for one configuration; :meth:`setup` (untimed) once, then :meth:`run` as
    often as the runner likes (``n`` transfers, each timed on its own and delivered when it
    returns), :meth:`verify` once after the timing, :meth:`close` in any case. Used from the
    writer's main thread only. ``name`` is its name in the report; ``family`` groups names
    (``raw-nixl`` and ``raw-nixl-repost`` are both ``raw``).
    """

    family = ""

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self) -> None:  # noqa: B027 - a hook
        """Untimed preparation before the first :meth:`run`."""

    @abstractmethod
    def step(self) -> None:
        """One transfer, delivered when it returns."""

    def run(self, n: int) -> list[int]:
        """``n`` transfers; the wall time of each in nanoseconds."""
        clock, out = time.perf_counter_ns, []
        for _ in range(n):
            t0 = clock()
            self.step()
            out.append(clock() - t0)
        return out

    @abstractmethod
    def verify(self, seed: int) -> bool:
        """One transfer of fresh bytes (the pattern of ``seed``), checked where they land."""

    def extra(self) -> dict[str, Any]:
        """Fields of this system's record besides the timing (after :meth:`verify`)."""
        return {}

    def close(self) -> None:  # noqa: B027 - a hook
        """Release what :meth:`setup` or the constructor took."""


@dataclass
class Route:
    """Where one configuration's bytes come from and land, so that a system can be verified:
    ``op`` "write": the writer's ``local[0]`` tensors to the tensors ``spec`` names on every
    peer; "read": each peer ``i``'s into the writer's ``local[i]``. ``dist``: the peers' copies
    for torch.distributed instead of the tensors they expose. :meth:`verify` zeroes the
    destination, fills the source with the pattern of ``seed`` (``seed + 1000 * i`` at peer
    ``i`` for a read), makes one transfer and checks every byte."""

    s: Session
    peers: list[str]
    spec: dict[str, Any]
    op: str = "write"
    local: list[list[torch.Tensor]] | None = None
    dist: bool = False

    def ask(self, cmd: str, **fields: Any) -> list[dict[str, Any]]:
        return self.s.ask(self.peers, cmd, spec=self.spec, dist=self.dist, **fields)

    def verify(self, step: Callable[[], object], seed: int) -> bool:
        local = self.local or [[]]
        if self.op == "write":
            self.ask("zero")
            fill_all(local[0], seed)
            step()
            return all(m["ok"] for m in self.ask("check", seed=seed))
        self.ask("fill", per_peer=lambda i: {"seed": seed + 1000 * i})
        zero_all([x for xs in local for x in xs])
        step()
        return all(check_all(xs, seed + 1000 * i) for i, xs in enumerate(local))


class Ours(System):
    """A transfer through our Transport: ``fn`` makes one (put, get or several) and waits."""

    family = "ours"

    def __init__(self, name: str, fn: Callable[[], object], route: Route) -> None:
        super().__init__(name)
        self.fn, self.route = fn, route

    def step(self) -> None:
        self.fn()

    def verify(self, seed: int) -> bool:
        return self.route.verify(self.step, seed)


class RawNixl(Ours):
    """Raw NIXL over a prepared :class:`RawPath`: ``raw-nixl`` makes, posts, polls and releases a
    handle per transfer; ``repost`` reposts one prepared handle. The system that ``owns`` the path
    closes it; ``probe`` untimed transfers add the cost of each NIXL call to the record."""

    family = "raw"

    def __init__(self, name: str, path: RawPath, route: Route, repost: bool = False,
                 owns: bool = True, probe: int = 0) -> None:  # fmt: skip
        super().__init__(name, path.repost if repost else path.make_post, route)
        self.path, self.owns, self.probe = path, owns, probe

    def extra(self) -> dict[str, Any]:
        return self.path.probe(self.probe) if self.probe else {}

    def close(self) -> None:
        if self.owns:
            self.path.close()


class Dist(System):
    """gloo or NCCL through an open :class:`Group`: ``mode`` "p2p" (send/recv) or "bcast", each
    operation acked by the first ``len(route.peers)`` readers. :meth:`run` tells those readers
    how many operations come, then times the writer's side of each."""

    def __init__(self, name: str, group: Group, mode: str, xs: list[torch.Tensor],
                 route: Route) -> None:  # fmt: skip
        super().__init__(name)
        self.family = name.split("-")[0]
        self.group, self.mode, self.xs, self.route = group, mode, xs, route

    def step(self) -> None:
        self.run(1)

    def run(self, n: int) -> list[int]:
        r, k = self.route, len(self.route.peers)
        for p in r.peers:
            r.s.send(p, "dist-run", mode=self.mode, recv=k, spec=r.spec, count=n)
        clock, out = time.perf_counter_ns, []
        for _ in range(n):
            t0 = clock()
            self.group.write(self.mode, self.xs, k)
            out.append(clock() - t0)
        for p in r.peers:
            r.s.recv(p)
        return out

    def verify(self, seed: int) -> bool:
        return self.route.verify(self.step, seed)

    def extra(self) -> dict[str, Any]:
        return {"device": str(self.group.device)}


class Memcpy(System):
    """``dst.copy_(src)`` of every tensor, ``repeat`` times, in the writer (its torch threads)."""

    family = "memcpy"

    def __init__(self, src: list[torch.Tensor], repeat: int = 1) -> None:
        super().__init__("memcpy")
        self.src, self.repeat = src, repeat
        self.dst = [torch.zeros_like(x) for x in src]

    def step(self) -> None:
        for _ in range(self.repeat):
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s)

    def verify(self, seed: int) -> bool:
        fill_all(self.src, seed)
        self.step()
        return check_all(self.dst, seed)


# -- torch.distributed: rank 0 is the writer, rank i + 1 the reader i -----------------------------


def my_address(store_url: str | None) -> str:
    """The address peers should use to reach this host: the one that routes to the store's host
    (loopback when the store is local or unknown)."""
    host = urlsplit(store_url).hostname if store_url and "://" in store_url else None
    try:
        if not host or ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def device_for(backend: str, index: int) -> str:
    return "cpu" if backend != "nccl" else f"cuda:{index % torch.cuda.device_count()}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: collectives move bytes whatever the dtype."""
    return t.reshape(-1).view(torch.uint8)


class Group:
    """One process's membership of the benchmark's process group (gloo over TCP, NCCL), and the
    sub-groups of ranks 0..k for every receiver count k, made by every rank in the same order.
    Every operation ends with a 1-byte ack from each receiver, so the writer's time covers
    delivery: ``p2p`` sends to each of the first ``k`` receivers; ``bcast`` broadcasts in the
    group of ranks 0..k. :meth:`close` destroys the group (one per process at a time)."""

    def __init__(self, backend: str, addr: str, port: int, rank: int, world: int,
                 ks: Sequence[int], device: str) -> None:  # fmt: skip
        import torch.distributed as dist

        if addr.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.dist, self.rank, self.device = dist, rank, torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))  # fmt: skip
        self.groups = {k: dist.new_group(list(range(k + 1))) if k + 1 < world else None
                       for k in sorted(set(ks))}  # fmt: skip
        self.ack = torch.zeros(1, dtype=torch.uint8, device=self.device)

    @classmethod
    def open(cls, s: Session, backend: str, ks: Sequence[int]) -> Group:
        """The writer's side (rank 0): tells each reader to join (``dist-init``), joins, and
        returns once every reader has."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        addr, world = my_address(getattr(s.t.store, "url", None)), len(s.readers) + 1
        for i, r in enumerate(s.readers):
            s.send(r, "dist-init", backend=backend, addr=addr, port=port, rank=i + 1, world=world,
                   ks=list(ks), device=s.device_of(i + 1))  # fmt: skip
        group = cls(backend, addr, port, 0, world, ks, device_for(backend, s.device_of(0)))
        for r in s.readers:
            s.recv(r)
        return group

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def write(self, mode: str, tensors: Sequence[torch.Tensor], k: int) -> None:
        """Rank 0: deliver ``tensors`` to ranks 1..k and wait for their acks."""
        d = self.dist
        if mode == "p2p":
            for q in [d.isend(t, r) for r in range(1, k + 1) for t in tensors]:
                q.wait()
        else:
            for t in tensors:
                d.broadcast(t, 0, group=self.groups[k])
        for r in range(1, k + 1):
            d.recv(self.ack, r)
        self._sync()

    def read(self, mode: str, tensors: Sequence[torch.Tensor], k: int) -> None:
        """Rank 1..k: the other side of :meth:`write`."""
        if self.rank > k:
            return
        for t in tensors:
            if mode == "p2p":
                self.dist.recv(t, 0)
            else:
                self.dist.broadcast(t, 0, group=self.groups[k])
        self.dist.send(self.ack, 0)
        self._sync()

    def close(self, s: Session | None = None) -> None:
        """Leave the group; the writer passes its session to have its readers leave too."""
        for r in s.readers if s else []:
            s.send(r, "dist-end")  # type: ignore[union-attr]
        self.dist.destroy_process_group()
        for r in s.readers if s else []:
            s.recv(r)  # type: ignore[union-attr]
