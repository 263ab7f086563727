"""Raw NIXL: the same transfers as ours, written the way a direct NIXL user writes them: an agent
without progress thread (sync mode STRICT), metadata exchanged through the store, descriptor
lists prepared once per size on both sides, then per transfer ``make_prepped_xfer`` +
``transfer`` + poll ``check_xfer_state`` to DONE + ``release`` ("raw-nixl", the reference of
every ratio), or one prepared handle reposted ("raw-nixl-repost", the tightest baseline).

The target must make NIXL progress calls (``get_new_notifs``) at least until the first transfer
has connected, and all the time over transports other than CMA; bench readers do every 0.5 ms.
``python -m transport.cli.bench._raw`` (with UCX_PROTO_INFO=y) makes one put and one get between
two agents of one process, so that UCX prints the protocols it picks on this host.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

XFER_TIMEOUT_S = float(os.environ.get("BENCH_XFER_TIMEOUT", "60"))


def new_agent(name: str) -> Any:
    from transport.backends.nixl import _load

    api, _ = _load()
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, sync_mode=sync))


def add_remote(agent: Any, md: bytes) -> str:
    name = agent.add_remote_agent(md)
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def descs(pairs: Sequence[tuple[int, int]]) -> np.ndarray:
    """NIXL descriptors of (address, bytes) pairs."""
    return np.array([(a, n, 0) for a, n in pairs], dtype=np.uint64)


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
    """Prepared descriptor lists for one op (WRITE or READ) between local tensors and remote
    addresses, per target ``(agent name, local tensors, remote addresses)``. ``make_post`` and
    ``repost`` each move the bytes once to (or from) every target: all posted, then polled.
    Owns its descriptor lists and reposted handles until :meth:`close`."""

    def __init__(self, agent: Any, op: str, targets: Sequence[tuple[str, list[torch.Tensor], Sequence[int]]],
                 notif: bytes = b"") -> None:  # fmt: skip
        self.agent, self.op, self.notif, self.sides = agent, op, notif, []
        for rname, xs, addrs in targets:
            lp = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", descs([(x.data_ptr(), x.nbytes) for x in xs]), "DRAM"
            )
            rp = agent.prep_xfer_dlist(
                rname, descs([(a, x.nbytes) for a, x in zip(addrs, xs, strict=True)]), "DRAM"
            )
            self.sides.append((lp, rp, np.arange(len(xs), dtype=np.int32)))
        self.handles = [self._make(side) for side in self.sides]

    def _make(self, side: tuple[Any, Any, np.ndarray]) -> Any:
        lp, rp, idx = side
        return self.agent.make_prepped_xfer(self.op, lp, idx, rp, idx, notif_msg=self.notif)

    def _post(self, handles: list[Any]) -> None:
        for h, st in [(h, self.agent.transfer(h)) for h in handles]:
            poll_done(self.agent, h, st)

    def make_post(self) -> None:
        self._post(hs := [self._make(side) for side in self.sides])
        for h in hs:
            h.release()

    def repost(self) -> None:
        self._post(self.handles)

    def probe(self, k: int) -> dict[str, float]:
        """``k`` untimed transfers to the first target, each NIXL call timed on its own: how often
        transfer() returned DONE at once, polls per transfer, and the medians of
        make_prepped_xfer, transfer() and release()."""
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
        return {"post_returned_done": immediate / k, "polls_per_xfer": polls / k,
                "make_median_s": med(make), "transfer_call_median_s": med(post),
                "release_median_s": med(rel)}  # fmt: skip

    def close(self) -> None:
        for h in self.handles:
            h.release()
        for lp, rp, _ in self.sides:
            lp.release()
            rp.release()


class RawLink:
    """The writer's raw NIXL agent in a session ``s``: registered with its ``local`` tensors, its
    metadata published, every reader's agent added (with the addresses each published,
    ``blobs[i]``), and each reader told to add the writer's. Paths made by :meth:`path` belong to
    the caller; :meth:`close` removes the remote agents."""

    def __init__(self, s: Any, local: list[torch.Tensor]) -> None:
        from transport.cli.bench._session import get_blob, put_blob

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
        path = self.path("WRITE", [([local.view(-1).view(torch.uint8)[:64]], [raddr])], i)
        path.repost()
        path.close()
        return time.perf_counter() - t0

    def path(self, op: str, pairs: Sequence[tuple[list[torch.Tensor], Sequence[int]]], first: int = 0,
             notif: bytes = b"") -> RawPath:  # fmt: skip
        """``pairs[i]``: (local tensors, the addresses they pair with at reader ``first + i``)."""
        targets = [
            (name, xs, addrs) for name, (xs, addrs) in zip(self.names[first:], pairs, strict=False)
        ]
        return RawPath(self.agent, op, targets, notif)

    def close(self) -> None:
        for name in self.names:
            self.agent.remove_remote_agent(name)


def main() -> None:
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
