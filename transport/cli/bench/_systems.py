"""The System contract and the systems both commands share: ours, raw NIXL, gloo and NCCL (over
torch.distributed) and memcpy; ``bench sync`` adds its publisher.

Raw NIXL is written as a direct NIXL user writes it: an agent without progress thread, metadata
through the store, descriptor lists prepared once per size, then per transfer make + post + poll
to DONE + release ("raw-nixl", the reference of every ratio), or one prepared handle reposted
("raw-nixl-repost"). Its target must make progress calls (bench readers do every 0.5 ms).
``python -m transport.cli.bench._systems`` (with UCX_PROTO_INFO=y) makes one put and one get
between two agents, so that UCX prints the protocols it picks on this host.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from transport.cli.bench._session import Session, get_blob, put_blob
from transport.cli.bench._util import check_all, fill_all, zero_all
from transport.store import reserve_port

XFER_TIMEOUT_S = float(os.environ.get("BENCH_XFER_TIMEOUT", "60"))


@dataclass
class Route:
    """Where a configuration's bytes come from and land: "write" from the writer's ``local[0]``
    to what ``spec`` names on every peer (``dist``: their collectives' copies), "read" from peer
    ``i`` into ``local[i]``. :meth:`verify` zeroes the destination, fills the source with the
    pattern of ``seed`` (``+ 1000 * i`` at peer ``i``), makes one transfer, checks every byte."""

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


class System:
    """One way of moving one configuration's bytes, the contract every measured system keeps:
    :meth:`setup` (untimed) once, :meth:`run` as often as the runner likes, :meth:`verify` once
    after the timing, :meth:`close` in any case; writer's main thread only. ``family`` groups
    names (raw-nixl, raw-nixl-repost: raw). This base moves bytes with ``fn`` (one transfer,
    delivered when it returns; "ours") and verifies them along its ``route``."""

    family = "ours"

    def __init__(
        self, name: str, fn: Callable[[], object] | None = None, route: Route | None = None
    ) -> None:
        self.name, self.fn, self.route = name, fn, route

    def setup(self) -> None:
        """Untimed preparation before the first :meth:`run`."""

    def step(self) -> None:
        self.fn()  # type: ignore[misc]

    def run(self, n: int) -> list[int]:
        """``n`` transfers; the wall time of each in nanoseconds."""
        clock, out = time.perf_counter_ns, []
        for _ in range(n):
            t0 = clock()
            self.step()
            out.append(clock() - t0)
        return out

    def verify(self, seed: int) -> bool:
        """One transfer of fresh bytes (the pattern of ``seed``), checked where they land."""
        return self.route.verify(self.step, seed)  # type: ignore[union-attr]

    def extra(self) -> dict[str, Any]:
        """Fields of this system's record besides the timing (after :meth:`verify`)."""
        return {}

    def close(self) -> None:
        """Release what :meth:`setup` or the constructor took."""


class Memcpy(System):
    """``dst.copy_(src)`` of every tensor, ``repeat`` times, in the writer (its torch threads)."""

    family = "memcpy"

    def __init__(self, src: list[torch.Tensor], repeat: int = 1) -> None:
        super().__init__("memcpy")
        self.src, self.repeat, self.dst = src, repeat, [torch.zeros_like(x) for x in src]

    def step(self) -> None:
        for _ in range(self.repeat):
            for d, s in zip(self.dst, self.src, strict=True):
                d.copy_(s)

    def verify(self, seed: int) -> bool:
        fill_all(self.src, seed)
        self.step()
        return check_all(self.dst, seed)


# -- raw NIXL -------------------------------------------------------------------------------------


def new_agent(name: str) -> Any:
    from transport.backends.nixl import load_nixl

    api, _ = load_nixl()
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, sync_mode=sync))


def add_remote(agent: Any, md: bytes) -> str:
    name = agent.add_remote_agent(md)
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def poll_done(agent: Any, h: Any, st: str) -> None:
    deadline, n = time.monotonic() + XFER_TIMEOUT_S, 0
    while st == "PROC":
        st = agent.check_xfer_state(h)
        n += 1
        if (n & 0x3FF) == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"raw NIXL transfer still PROC after {XFER_TIMEOUT_S} s")
    if st != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended in state {st}")


class RawPath:
    """Descriptor lists for one op (WRITE or READ) per target (agent, local tensors, remote
    addresses), prepared once; ``make_post`` and ``repost`` move the bytes once to (or from)
    every target, all posted then polled. Owns the lists and reposted handles until closed."""

    def __init__(
        self,
        agent: Any,
        op: str,
        targets: Sequence[tuple[str, list[torch.Tensor], Sequence[int]]],
        notif: bytes = b"",
    ) -> None:
        self.agent, self.op, self.notif, self.sides = agent, op, notif, []
        descs = lambda pairs: np.array([(a, n, 0) for a, n in pairs], dtype=np.uint64)  # noqa: E731
        for rname, xs, addrs in targets:
            mine = [(x.data_ptr(), x.nbytes) for x in xs]
            theirs = [(a, x.nbytes) for a, x in zip(addrs, xs, strict=True)]
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(mine), "DRAM")
            rp = agent.prep_xfer_dlist(rname, descs(theirs), "DRAM")
            self.sides.append((lp, rp, np.arange(len(xs), dtype=np.int32)))
        self.handles = [self._make(side) for side in self.sides]

    def _make(self, side: tuple[Any, Any, np.ndarray]) -> Any:
        lp, rp, idx = side
        return self.agent.make_prepped_xfer(self.op, lp, idx, rp, idx, notif_msg=self.notif)

    def _post(self, handles: list[Any]) -> None:
        # written out plainly, as a NIXL user would: this loop is the reference of every ratio,
        # and its 4 KiB figure moved by several percent when it was written more tersely
        states = [self.agent.transfer(h) for h in handles]
        for h, st in zip(handles, states, strict=True):
            poll_done(self.agent, h, st)

    def make_post(self) -> None:
        handles = [self._make(side) for side in self.sides]
        self._post(handles)
        for h in handles:
            h.release()

    def repost(self) -> None:
        self._post(self.handles)

    def probe(self, k: int) -> dict[str, float]:
        """``k`` untimed transfers to the first target, each NIXL call timed on its own."""
        immediate = polls = 0
        make, post, rel = [], [], []
        clock = time.perf_counter_ns
        for _ in range(k):
            t0 = clock()
            h = self._make(self.sides[0])
            t1 = clock()
            st = self.agent.transfer(h)
            make.append(t1 - t0)
            post.append(clock() - t1)
            immediate += st == "DONE"
            while st == "PROC":
                polls += 1
                st = self.agent.check_xfer_state(h)
            poll_done(self.agent, h, st)
            t3 = clock()
            h.release()
            rel.append(clock() - t3)
        med = lambda xs: statistics.median(xs) / 1e9  # noqa: E731
        return {
            "post_returned_done": immediate / k,
            "polls_per_xfer": polls / k,
            "make_median_s": med(make),
            "transfer_call_median_s": med(post),
            "release_median_s": med(rel),
        }

    def close(self) -> None:
        for h in self.handles:
            h.release()
        for lp, rp, _ in self.sides:
            lp.release()
            rp.release()


class RawLink:
    """The writer's raw NIXL agent: ``local`` registered, metadata exchanged with every reader
    (``blobs[i]``: what reader ``i`` published). Paths from :meth:`path` belong to the caller."""

    def __init__(self, s: Session, local: list[torch.Tensor]) -> None:
        self.agent = new_agent(f"raw-{s.t.name}")
        self.agent.register_memory(local)
        put_blob(s.t, "raw", {"md": self.agent.get_agent_metadata()})
        self.blobs = [get_blob(s.t, r, "raw") for r in s.readers]
        self.names = [add_remote(self.agent, b["md"]) for b in self.blobs]
        s.ask(s.readers, "raw-md", writer=s.t.name)

    def connect(self, i: int, local: torch.Tensor, raddr: int) -> float:
        """A first 64-byte WRITE to reader ``i``: UCX connects lazily, here and not inside a timed
        size (the target must be making progress calls). Returns its wall time in seconds."""
        t0 = time.perf_counter()
        first = local.view(-1).view(torch.uint8)[:64]
        path = RawPath(self.agent, "WRITE", [(self.names[i], [first], [raddr])])
        path.repost()
        path.close()
        return time.perf_counter() - t0

    def path(
        self, op: str, pairs: Sequence[tuple[list[torch.Tensor], Sequence[int]]], notif: bytes = b""
    ) -> RawPath:
        """``pairs[i]``: (local tensors, the addresses they pair with at reader ``i``)."""
        targets = [(name, xs, addrs) for name, (xs, addrs) in zip(self.names, pairs, strict=False)]
        return RawPath(self.agent, op, targets, notif)

    def close(self) -> None:
        for name in self.names:
            self.agent.remove_remote_agent(name)


class RawNixl(System):
    """Raw NIXL over a prepared :class:`RawPath`: ``raw-nixl`` makes, posts, polls and releases a
    handle per transfer; ``repost`` reposts one prepared handle. The system that ``owns`` the path
    closes it; ``probe`` untimed transfers add the cost of each NIXL call to the record."""

    family = "raw"

    def __init__(
        self,
        name: str,
        path: RawPath,
        route: Route,
        repost: bool = False,
        owns: bool = True,
        probe: int = 0,
    ) -> None:
        super().__init__(name, path.repost if repost else path.make_post, route)
        self.path, self.owns, self.probe = path, owns, probe

    def extra(self) -> dict[str, Any]:
        return self.path.probe(self.probe) if self.probe else {}

    def close(self) -> None:
        if self.owns:
            self.path.close()


# -- torch.distributed: rank 0 is the writer, rank i + 1 the reader i -----------------------------


def device_for(backend: str, index: int) -> str:
    return "cpu" if backend != "nccl" else f"cuda:{index % torch.cuda.device_count()}"


class Group:
    """One process's membership of the run's process group (gloo, NCCL) and its sub-groups of
    ranks 0..k per receiver count k. Each operation (``p2p``: send to ranks 1..k; ``bcast``: in
    the sub-group) ends with a 1-byte ack per receiver, so it covers delivery. One per process."""

    def __init__(self, m: dict[str, Any], device: str) -> None:
        """Join as rank ``m["rank"]`` (``m``: the fields of ``dist-init``), on ``device``."""
        import torch.distributed as dist

        if m["addr"].startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.dist, self.rank, self.device, world = dist, m["rank"], torch.device(device), m["world"]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            m["backend"],
            init_method=f"tcp://{m['addr']}:{m['port']}",
            rank=self.rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        self.groups = {
            k: dist.new_group(list(range(k + 1))) if k + 1 < world else None
            for k in sorted(set(m["ks"]))
        }
        self.ack = torch.zeros(1, dtype=torch.uint8, device=self.device)

    @classmethod
    def open(cls, s: Session, backend: str, ks: Sequence[int]) -> Group:
        """Rank 0, at the address that routes to the store's host: every reader joins too. The
        group's port is held until rank 0 has bound it (transport/store/ports.py)."""
        with reserve_port() as held:
            return cls._open(s, backend, ks, held.port)

    @classmethod
    def _open(cls, s: Session, backend: str, ks: Sequence[int], port: int) -> Group:
        url, addr = getattr(s.t.store, "url", None), "127.0.0.1"
        host = urlsplit(url).hostname if url and "://" in url else None
        try:
            if host and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    sock.connect((host, 9))
                    addr = str(sock.getsockname()[0])
        except OSError:
            pass
        m = {
            "backend": backend,
            "addr": addr,
            "port": port,
            "world": len(s.readers) + 1,
            "ks": list(ks),
        }
        for i, r in enumerate(s.readers):
            s.send(r, "dist-init", **m, rank=i + 1, device=s.device_of(i + 1))
        group = cls({**m, "rank": 0}, device_for(backend, s.device_of(0)))
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


class Dist(System):
    """gloo or NCCL through an open :class:`Group`: ``mode`` "p2p" (send/recv) or "bcast", each
    operation acked by the first ``len(route.peers)`` readers. :meth:`run` tells those readers
    how many operations come, then times the writer's side of each."""

    def __init__(
        self, name: str, group: Group, mode: str, xs: list[torch.Tensor], route: Route
    ) -> None:
        super().__init__(name, route=route)
        self.family, self.group, self.mode, self.xs = name.split("-")[0], group, mode, xs

    def step(self) -> None:
        self.run(1)

    def run(self, n: int) -> list[int]:
        r: Route = self.route  # type: ignore[assignment]
        k = len(r.peers)
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

    def extra(self) -> dict[str, Any]:
        return {"device": str(self.group.device)}


def main() -> None:
    """One put and one get between two agents of this process (the UCX probe)."""
    a, b = new_agent("bench-probe-a"), new_agent("bench-probe-b")
    x, y = torch.ones(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    a.register_memory(x)
    b.register_memory(y)
    name = add_remote(a, b.get_agent_metadata())
    for op in ("WRITE", "READ"):
        path = RawPath(a, op, [(name, [x], [y.data_ptr()])])
        st = a.transfer(h := path.handles[0])
        while st == "PROC":
            b.get_new_notifs()
            st = a.check_xfer_state(h)
        path.close()


if __name__ == "__main__":
    main()
