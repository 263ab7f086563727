"""torch.distributed baselines: gloo over TCP (CPU tensors) and NCCL (CUDA tensors).

Rank 0 is the writer, rank ``i + 1`` the reader ``i``. Every operation ends with a 1-byte ack
from each receiver, so the writer's time covers delivery, not just handing the bytes over:

* ``p2p``: ``isend`` to each of the first ``k`` receivers, wait, then receive their acks;
* ``bcast``: ``broadcast`` from rank 0 in the group of ranks 0..k, then the acks.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import torch


def my_address(store_url: str | None) -> str:
    """The address peers should use to reach this host: the one that routes to the store's host
    (loopback when the store is local or unknown)."""
    host = urlsplit(store_url).hostname if store_url and "://" in store_url else None
    if not host:
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Group:
    """One process's membership of the benchmark's process group, and the sub-groups of ranks
    0..k for every receiver count k. Every rank creates every sub-group, in the same order;
    :meth:`close` destroys the group (one group per process at a time)."""

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
        self.groups = {
            k: dist.new_group(list(range(k + 1))) if k + 1 < world else None
            for k in sorted(set(ks))
        }
        self.ack = torch.zeros(1, dtype=torch.uint8, device=self.device)

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

    def close(self) -> None:
        self.dist.destroy_process_group()


def open_group(chan: Any, store_url: str | None, peers: Sequence[str], backend: str,
               ks: Sequence[int], device_of: Callable[[int], int]) -> Group:  # fmt: skip
    """The writer's side of starting a process group with its readers (rank 0 = the writer):
    tells each reader (command ``dist-init``) and joins; returns once every reader has joined.
    ``device_of(rank)``: the CUDA device index each rank uses (NCCL)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    addr, world = my_address(store_url), len(peers) + 1
    for i, r in enumerate(peers):
        chan.send(r, "dist-init", backend=backend, addr=addr, port=port, rank=i + 1, world=world,
                  ks=list(ks), device=device_of(i + 1))  # fmt: skip
    group = Group(backend, addr, port, 0, world, ks, device_for(backend, device_of(0)))
    for r in peers:
        chan.recv(r)
    return group


def close_group(chan: Any, peers: Sequence[str], group: Group) -> None:
    for r in peers:
        chan.send(r, "dist-end")
    group.close()
    for r in peers:
        chan.recv(r)


def device_for(backend: str, index: int) -> str:
    return "cpu" if backend != "nccl" else f"cuda:{index % torch.cuda.device_count()}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: collectives move bytes whatever the dtype."""
    return t.reshape(-1).view(torch.uint8)
