"""Raw NIXL: the same transfers as ours, written the way a direct NIXL user writes them.

* ``nixl_agent(name, nixl_agent_config(enable_prog_thread=False, sync_mode=STRICT))``
* register the buffers, exchange metadata (here through the store), ``prep_xfer_dlist`` once
  per size on both sides
* per iteration ``make_prepped_xfer`` + ``transfer`` + poll ``check_xfer_state`` to "DONE" +
  ``release()`` -> system "raw-nixl" (the reference of every ratio)
* one prepared handle reposted with ``transfer(h)`` after each DONE -> "raw-nixl-repost" (the
  tightest possible baseline)

The target of a raw transfer must make NIXL progress calls (``get_new_notifs``) at least until
the first transfer has connected (UCX wire-up), and all the time over transports other than CMA;
the bench readers call it every 0.5 ms while they wait for commands.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

XFER_TIMEOUT_S = float(os.environ.get("BENCH_XFER_TIMEOUT", "60"))


def new_agent(name: str) -> Any:
    from transport.backends.nixl import _load

    api, _ = _load()
    conf = api.nixl_agent_config(
        enable_prog_thread=False, sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    return api.nixl_agent(name, conf)


def remote_name(x: object) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def poll_done(agent: Any, h: Any, st: str) -> None:
    if st == "PROC":
        deadline = time.monotonic() + XFER_TIMEOUT_S
        check = agent.check_xfer_state
        n = 0
        while True:
            st = check(h)
            if st != "PROC":
                break
            n += 1
            if (n & 0x3FF) == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL transfer still PROC after {XFER_TIMEOUT_S} s")
    if st != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended in state {st}")


def descs(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.array([(t.data_ptr(), t.nbytes, 0) for t in tensors], dtype=np.uint64)


def remote_descs(addrs: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    return np.array([(a, n, 0) for a, n in zip(addrs, sizes, strict=True)], dtype=np.uint64)


class RawPath:
    """Prepared descriptor lists for one op (WRITE or READ) between local tensors and each of
    ``len(targets)`` remote agents; ``make_post`` and ``repost`` each move the bytes once to (or
    from) every target: all transfers posted first, then polled."""

    def __init__(
        self,
        agent: Any,
        op: str,
        targets: Sequence[tuple[str, np.ndarray, np.ndarray]],
        notif: bytes = b"",
    ) -> None:
        """``targets``: (remote agent, local descriptors, remote descriptors) per peer."""
        self.agent, self.op, self.notif = agent, op, notif
        self.sides = []
        for rname, local, remote in targets:
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
            rp = agent.prep_xfer_dlist(rname, remote, "DRAM")
            idx = np.arange(len(local), dtype=np.int32)
            self.sides.append((lp, rp, idx))
        self.handles = [
            agent.make_prepped_xfer(op, lp, idx, rp, idx, notif_msg=notif)
            for lp, rp, idx in self.sides
        ]

    def make_post(self) -> None:
        agent, op, notif = self.agent, self.op, self.notif
        hs = [
            agent.make_prepped_xfer(op, lp, i, rp, i, notif_msg=notif) for lp, rp, i in self.sides
        ]
        sts = [agent.transfer(h) for h in hs]
        for h, st in zip(hs, sts, strict=True):
            poll_done(agent, h, st)
        for h in hs:
            h.release()

    def repost(self) -> None:
        agent = self.agent
        sts = [agent.transfer(h) for h in self.handles]
        for h, st in zip(self.handles, sts, strict=True):
            poll_done(agent, h, st)

    def probe(self, k: int) -> dict[str, float]:
        """Untimed: how often transfer() returns DONE at once, polls per transfer, and the median
        cost of make_prepped_xfer / transfer() / release() (first target only)."""
        agent, (lp, rp, idx) = self.agent, self.sides[0]
        immediate = polls = 0
        make: list[int] = []
        post: list[int] = []
        rel: list[int] = []
        clock = time.perf_counter_ns
        for _ in range(k):
            t0 = clock()
            h = agent.make_prepped_xfer(self.op, lp, idx, rp, idx, notif_msg=self.notif)
            t1 = clock()
            st = agent.transfer(h)
            t2 = clock()
            make.append(t1 - t0)
            post.append(t2 - t1)
            immediate += st == "DONE"
            while st == "PROC":
                polls += 1
                st = agent.check_xfer_state(h)
            if st != "DONE":
                raise RuntimeError(f"raw NIXL transfer ended in state {st}")
            t3 = clock()
            h.release()
            rel.append(clock() - t3)
        return {
            "post_returned_done": immediate / k,
            "polls_per_xfer": polls / k,
            "make_median_s": statistics.median(make) / 1e9,
            "transfer_call_median_s": statistics.median(post) / 1e9,
            "release_median_s": statistics.median(rel) / 1e9,
        }

    def close(self) -> None:
        for h in self.handles:
            h.release()
        for lp, rp, _ in self.sides:
            lp.release()
            rp.release()


def connect(agent: Any, rname: str, local: torch.Tensor, raddr: int) -> float:
    """A first 64-byte WRITE: UCX connects lazily, here and not inside a timed size (the target
    must be making progress calls). Returns its wall time in seconds."""
    t0 = time.perf_counter()
    path = RawPath(
        agent,
        "WRITE",
        [(rname, descs([local.view(-1).view(torch.uint8)[:64]]), remote_descs([raddr], [64]))],
    )
    path.repost()
    path.close()
    return time.perf_counter() - t0


ProgressFn = Callable[[], object]
