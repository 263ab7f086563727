"""The System contract and the systems both bench commands share: ours (a transfer through our
Transport), raw NIXL, gloo and NCCL (one class over torch.distributed) and memcpy.

A workload builds a configuration's systems; the runner (``_runner``) sets them up, times them,
verifies each once and closes them. ``bench sync`` adds one system of its own (the publisher).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from transport.cli.bench._control import Channel
from transport.cli.bench._dist import Group
from transport.cli.bench._raw import RawPath
from transport.cli.bench._util import check_pattern, fill_pattern, zero_bytes


class System(ABC):
    """One way of moving one configuration's bytes: the contract every measured system keeps.

    Lifecycle: built by a workload for one configuration; :meth:`setup` (untimed) once, then
    :meth:`run` as often as the runner likes (each call ``n`` transfers, each timed on its own,
    every one delivered when it returns), :meth:`verify` once after the timing, :meth:`close`
    in any case. A system holds no lock and is used from the writer's main thread only.
    ``name`` is the system's name in the report; ``family`` groups names (``raw-nixl`` and
    ``raw-nixl-repost`` are both ``raw``).
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


def fill_all(tensors: list[torch.Tensor], seed: int) -> None:
    for j, x in enumerate(tensors):
        fill_pattern(x, seed + j)


def check_all(tensors: list[torch.Tensor], seed: int) -> bool:
    return all(check_pattern(x, seed + j) for j, x in enumerate(tensors))


@dataclass
class Route:
    """Where one configuration's bytes come from and land, so that a system can be verified:
    ``op`` "write": the writer's ``local[0]`` tensors to the tensors ``spec`` names on every
    peer; "read": each peer ``i``'s into the writer's ``local[i]``. ``dist``: the peers' copies
    for torch.distributed (on their device) instead of the tensors they expose.

    :meth:`verify` zeroes the destination, fills the source with the pattern of ``seed`` (of
    ``seed + 1000 * i`` at peer ``i`` for a read), makes one transfer and checks every byte.
    """

    chan: Channel
    peers: list[str]
    spec: dict[str, Any]
    op: str = "write"
    local: list[list[torch.Tensor]] | None = None
    dist: bool = False

    def ask(self, cmd: str, **fields: Any) -> list[dict[str, Any]]:
        return self.chan.ask(self.peers, cmd, spec=self.spec, dist=self.dist, **fields)

    def verify(self, step: Callable[[], object], seed: int) -> bool:
        local = self.local or [[]]
        if self.op == "write":
            self.ask("zero")
            fill_all(local[0], seed)
            step()
            return all(m["ok"] for m in self.ask("check", seed=seed))
        self.ask("fill", per_peer=lambda i: {"seed": seed + 1000 * i})
        for xs in local:
            for x in xs:
                zero_bytes(x)
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
        return self.route.verify(self.fn, seed)


class RawNixl(System):
    """Raw NIXL over a prepared :class:`RawPath`: ``raw-nixl`` makes, posts, polls and releases a
    handle per transfer; ``repost`` reposts one prepared handle. The system that ``owns`` the path
    closes it; ``probe`` untimed transfers add the cost of each NIXL call to the record."""

    family = "raw"

    def __init__(self, name: str, path: RawPath, route: Route, repost: bool = False,
                 owns: bool = True, probe: int = 0) -> None:  # fmt: skip
        super().__init__(name)
        self.path, self.route, self.owns, self.probe = path, route, owns, probe
        self.fn = path.repost if repost else path.make_post

    def step(self) -> None:
        self.fn()

    def verify(self, seed: int) -> bool:
        return self.route.verify(self.fn, seed)

    def extra(self) -> dict[str, Any]:
        return asdict(self.path.probe(self.probe)) if self.probe else {}

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
            r.chan.send(p, "dist-run", mode=self.mode, recv=k, spec=r.spec, count=n)
        clock, out = time.perf_counter_ns, []
        for _ in range(n):
            t0 = clock()
            self.group.write(self.mode, self.xs, k)
            out.append(clock() - t0)
        for p in r.peers:
            r.chan.recv(p)
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
