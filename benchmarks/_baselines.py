"""Baselines for benchmarks/bench_core.py: raw NIXL, torch.distributed gloo, in-process memcpy.

Every two-process system runs as a writer and a receiver, each a fresh ``spawn`` child, joined
by a direct ``multiprocessing.Pipe`` (metadata, addresses, verification commands) and reporting
to the parent over a second pipe.  The writer times; the receiver only serves.

Raw NIXL is written the way a direct NIXL user writes it:

* ``nixl_agent(name, nixl_agent_config(enable_prog_thread=False, sync_mode=STRICT))``
* register the buffers, exchange metadata, ``prep_xfer_dlist`` once per size (both sides)
* per iteration ``make_prepped_xfer("WRITE")`` + ``transfer`` + poll ``check_xfer_state`` to
  "DONE" + ``release()``                                           -> system "raw-nixl"
* and the tightest baseline: one prepared xfer handle reposted with ``transfer(h)`` after each
  DONE                                                              -> system "raw-nixl-repost"

No notification is attached (the writer's own completion is what is timed).

The receiver keeps making NIXL progress calls (``get_new_notifs()``) while a size is running;
``recv_progress`` picks how: "sleep" (one call, then wait up to 0.5 ms on the control pipe),
"tight" (call in a busy loop) or "none" (after the first, connecting transfer: block on the
control pipe, no NIXL calls at all).  Measured here (NIXL 1.5.1, UCX defaults = CMA on one host):
the first transfer never completes without receiver progress (UCX wire-up needs the receiver),
but afterwards every WRITE completes inside ``transfer()`` itself ("DONE" at once, the writer
copies with process_vm_writev), so the mode only costs CPU; "tight" steals a core from the writer
on a 2-core machine.  With UCX_TLS=tcp the data lands only while the receiver makes progress, and
4 KiB latency follows the receiver's polling cadence (~1 ms with "sleep").

Each size is verified once per system on the receiver: the receiver zeroes the destination, the
writer fills the source with a pattern derived from a per-iteration seed, transfers, and the
receiver checks the pattern landed.  A mismatch fails the run (it never reports a number for a
transfer that moved nothing).

All numbers are per-iteration wall times (``time.perf_counter_ns``) summarised by their MEDIAN;
GB/s means 1e9 bytes per second.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Set before nixl / UCX is imported anywhere (children are spawned, so they re-import this module
# first and pick these up; the parent imports nixl at most through `import transport`).
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("UCX_LOG_LEVEL", "error")


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Resolves ``transport`` and ``transport.backends`` to one checkout (see use_tree)."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.dirs = dirs

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
        d = self.dirs.get(fullname)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(d, "__init__.py"), submodule_search_locations=[d]
        )


def use_tree(root: str) -> None:
    """Import ``transport`` from the checkout ``root`` (``root/transport``, and
    ``transport.backends`` from ``root/backends`` as pyproject.toml maps it), not from wherever an
    editable install points: a benchmark run from an exported copy of a commit then measures that
    commit only, not half of it and half of a working tree someone is editing."""
    dirs = {
        "transport": os.path.join(root, "transport"),
        "transport.backends": os.path.join(root, "backends"),
    }
    present = all(os.path.isfile(os.path.join(d, "__init__.py")) for d in dirs.values())
    if present and not any(isinstance(f, _TreeFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TreeFinder(dirs))


PIPE_TIMEOUT_S = 120.0  # longest a writer waits for one reply of its receiver
XFER_TIMEOUT_S = float(
    os.environ.get("BENCH_XFER_TIMEOUT", "60")
)  # longest one raw xfer may stay "PROC"


# --------------------------------------------------------------------------------------------
# small helpers shared with bench_core.py
# --------------------------------------------------------------------------------------------


def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def parse_size(text: str) -> int:
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", GiB)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    return int(float(t) * mult)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(system: str, label: str, nbytes: int, times_ns: list[int], **extra: Any) -> dict:
    ts = sorted(times_ns)
    med = statistics.median(ts) / 1e9
    rec = {
        "size": label,
        "bytes": nbytes,
        "system": system,
        "iters": len(ts),
        "median_s": med,
        "p10_s": ts[int(0.10 * (len(ts) - 1))] / 1e9,
        "p90_s": ts[int(0.90 * (len(ts) - 1))] / 1e9,
        "min_s": ts[0] / 1e9,
        "gbps": nbytes / med / 1e9 if med > 0 else float("inf"),
        "verified": False,
        "times_ns": list(times_ns),
    }
    rec.update(extra)
    return rec


def time_loop(fn: Callable[[], None], iters: int, warmup: int) -> list[int]:
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(iters):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


_PERIOD = 251  # prime: a shifted, truncated or misplaced copy cannot match by accident
_EXT = None


def _pattern(nbytes: int, seed: int):
    """Block of min(nbytes, 64 KiB) bytes: (i + seed) % 251, a view into one cached tensor."""
    global _EXT
    import torch

    blk = min(nbytes, 64 * KiB)
    if _EXT is None:
        _EXT = (torch.arange(64 * KiB + _PERIOD, dtype=torch.int32) % _PERIOD).to(torch.uint8)
    off = seed % _PERIOD
    return _EXT[off : off + blk]


def fill_pattern(t, seed: int) -> None:
    """Fill a contiguous 1-D uint8 tensor with the pattern for ``seed`` (size: a power of two)."""
    p = _pattern(t.numel(), seed)
    t.view(-1, p.numel()).copy_(p.expand(t.numel() // p.numel(), p.numel()))


def check_pattern(t, seed: int) -> bool:
    import torch

    p = _pattern(t.numel(), seed)
    return bool(torch.equal(t.view(-1, p.numel()), p.expand(t.numel() // p.numel(), p.numel())))


_T0 = time.perf_counter()


def dbg(msg: str) -> None:
    """Phase log on stderr when BENCH_DEBUG=1 (seconds since this process imported us)."""
    if os.environ.get("BENCH_DEBUG"):
        sys.stderr.write(f"[{os.getpid()} {time.perf_counter() - _T0:8.3f}] {msg}\n")
        sys.stderr.flush()


class PeerError(RuntimeError):
    pass


def peer_recv(conn, timeout: float = PIPE_TIMEOUT_S):
    """Receive one message from the other child; raise on its error report or on silence."""
    if not conn.poll(timeout):
        raise PeerError(f"no reply from the peer process within {timeout:.0f} s")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise PeerError(f"peer process failed:\n{msg[1]}")
    return msg


def run_pair(
    writer: Callable,
    receiver: Callable,
    cfg: dict,
    timeout: float,
    args: tuple = (),
) -> dict:
    """Run ``writer(peer_conn, parent_conn, cfg, *args)`` and ``receiver(peer_conn, cfg, *args)``
    as spawned children.  Returns the writer's final message: {"records": [...], "notes": [...]}
    or {"error": text}."""
    ctx = mp.get_context("spawn")
    w_peer, r_peer = ctx.Pipe()
    parent_end, w_parent = ctx.Pipe()
    pr = ctx.Process(target=_child_main, args=(receiver, (r_peer, cfg, *args)), daemon=True)
    pw = ctx.Process(target=_child_main, args=(writer, (w_peer, w_parent, cfg, *args)), daemon=True)
    pr.start()
    pw.start()
    result: dict
    try:
        if parent_end.poll(timeout):
            result = parent_end.recv()
        else:
            result = {"error": f"timed out after {timeout:.0f} s"}
    except EOFError:
        result = {"error": f"writer process died (exit code {pw.exitcode})"}
    for p in (pw, pr):
        p.join(15)
        if p.is_alive():
            p.kill()
            p.join(5)
    if "error" not in result and pr.exitcode not in (0, None):
        result.setdefault("notes", []).append(f"receiver exit code {pr.exitcode}")
    return result


def _child_main(fn: Callable, args: tuple) -> None:
    conn = args[0]
    try:
        import torch

        # Helper ops here (pattern fill/check) need no intra-op pool, and its worker threads
        # must not compete with the measured processes on a small machine.
        torch.set_num_threads(1)
        fn(*args)
    except BaseException:
        tb = traceback.format_exc()
        # tell both the peer (it may be waiting) and, for writers, the parent
        for c in args[:2]:
            if hasattr(c, "send"):
                with contextlib.suppress(Exception):
                    c.send(("error", tb) if c is conn else {"error": tb})
        sys.stderr.write(tb)
        sys.exit(1)


# --------------------------------------------------------------------------------------------
# in-process memcpy
# --------------------------------------------------------------------------------------------


def run_memcpy(cfg: dict) -> dict:
    import torch

    records = []
    for n, iters, warm in cfg["sizes"]:
        src = torch.empty(n, dtype=torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8)
        fill_pattern(src, 1)
        dst.fill_(0)
        times = time_loop(lambda dst=dst, src=src: dst.copy_(src), iters, warm)
        rec = summarize("memcpy", size_label(n), n, times)
        fill_pattern(src, 77)
        dst.copy_(src)
        rec["verified"] = check_pattern(dst, 77)
        if not rec["verified"]:
            raise RuntimeError("memcpy verification failed")
        records.append(rec)
        del src, dst
    return {
        "records": records,
        "notes": [f"memcpy: dst.copy_(src), one process, torch threads={torch.get_num_threads()}"],
    }


# --------------------------------------------------------------------------------------------
# raw NIXL
# --------------------------------------------------------------------------------------------


def _apply_env(cfg: dict) -> None:
    for k, v in cfg.get("env", {}).items():
        os.environ[k] = v


def _nixl_agent(name: str):
    from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    conf = nixl_agent_config(
        enable_prog_thread=False, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    return nixl_agent(name, conf)


def _remote_name(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _raw_receiver(peer, cfg: dict) -> None:
    _apply_env(cfg)
    import numpy as np
    import torch

    agent = _nixl_agent("raw-recv")
    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize = cfg["batch"][0], cfg["batch"][1]
    buf = torch.zeros(maxn, dtype=torch.uint8)
    batch = [torch.zeros(bsize, dtype=torch.uint8) for _ in range(bcount)]
    agent.register_memory(buf)
    if bcount:
        agent.register_memory(batch)
    peer.send(
        (
            "ready",
            agent.get_agent_metadata(),
            buf.data_ptr(),
            maxn,
            np.array([b.data_ptr() for b in batch], dtype=np.uint64),
        )
    )
    msg = peer_recv(peer)
    assert msg[0] == "md", msg
    agent.add_remote_agent(msg[1])
    peer.send(("ok",))

    def handle(msg) -> None:
        op = msg[0]
        if op == "zero":
            _, kind, n = msg
            if kind == "batch":
                for b in batch:
                    b.zero_()
            else:
                buf[:n].zero_()
            peer.send(("ok",))
        elif op == "check":
            _, kind, n, seed = msg
            if kind == "batch":
                ok = all(check_pattern(b, seed + i) for i, b in enumerate(batch))
            else:
                ok = check_pattern(buf[:n], seed)
            peer.send(("checked", ok))
        else:
            raise ValueError(f"unknown command {msg!r}")

    calls = serve_with_progress(peer, agent, cfg["recv_progress"], handle)
    if calls is not None:
        peer.send(("bye", calls))


def serve_with_progress(peer, agent, mode: str, handle: Callable[[tuple], None]) -> int | None:
    """The receiver's main loop: serve control messages from the writer while making NIXL
    progress calls (``agent.get_new_notifs()``) for the raw agent ``agent`` (None: no raw agent,
    just block on the pipe).

    ``mode``: "sleep" (one call, then wait up to 0.5 ms on the pipe), "tight" (busy loop, the pipe
    looked at every 64 calls) or "none" (after the writer's "connected": block on the pipe).
    Handles "connected", "stop" (returns the number of progress calls; the caller replies) and
    "error" (the writer failed and said so: returns None); every other message goes to
    ``handle(msg)``."""
    calls = 0
    spin = 0
    connected = False  # "none" still progresses until the first (connecting) transfer is done
    while True:
        if agent is None or (mode == "none" and connected):
            msg = peer.recv()
        elif mode in ("sleep", "none"):
            agent.get_new_notifs()
            calls += 1
            if not peer.poll(0.0005):
                continue
            msg = peer.recv()
        else:  # tight
            agent.get_new_notifs()
            calls += 1
            spin += 1
            if spin < 64 or not peer.poll(0):
                continue
            spin = 0
            msg = peer.recv()
        op = msg[0]
        if op == "stop":
            return calls
        if op == "error":
            return None
        if op == "connected":
            connected = True
        else:
            handle(msg)


def _poll_done(agent, h, st: str) -> None:
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


def raw_probe(agent, lp, rp, idx, k: int) -> dict:
    """Untimed: how often transfer() already returns DONE, polls per transfer, and the median
    cost of make_prepped_xfer / transfer() / release()."""
    immediate = polls = 0
    make_ns: list[int] = []
    post_ns: list[int] = []
    rel_ns: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(k):
        t0 = clock()
        h = agent.make_prepped_xfer("WRITE", lp, idx, rp, idx)
        t1 = clock()
        st = agent.transfer(h)
        t2 = clock()
        make_ns.append(t1 - t0)
        post_ns.append(t2 - t1)
        if st == "DONE":
            immediate += 1
        while st == "PROC":
            polls += 1
            st = agent.check_xfer_state(h)
        if st != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended in state {st}")
        t3 = clock()
        h.release()
        rel_ns.append(clock() - t3)
    return {
        "post_returned_done": immediate / k,
        "polls_per_xfer": polls / k,
        "make_median_s": statistics.median(make_ns) / 1e9,
        "transfer_call_median_s": statistics.median(post_ns) / 1e9,
        "release_median_s": statistics.median(rel_ns) / 1e9,
    }


def raw_variants(agent, lp, rp, idx):
    """(make_post, repost, repost_handle): one WRITE of the prepared lists per call, either
    make_prepped_xfer + transfer + poll + release ("raw-nixl") or reposting one handle
    ("raw-nixl-repost"; release the returned handle when done with the size)."""

    def make_post() -> None:
        h = agent.make_prepped_xfer("WRITE", lp, idx, rp, idx)
        _poll_done(agent, h, agent.transfer(h))
        h.release()

    rh = agent.make_prepped_xfer("WRITE", lp, idx, rp, idx)

    def repost() -> None:
        _poll_done(agent, rh, agent.transfer(rh))

    return make_post, repost, rh


def raw_connect(agent, rname: str, laddr: int, raddr: int) -> float:
    """A first 64-byte WRITE: UCX's lazy connect happens here, not inside a timed size (the
    receiver must be making progress).  Returns its wall time in seconds."""
    t0 = time.perf_counter()
    lp0 = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(laddr, 64, 0)], "DRAM")
    rp0 = agent.prep_xfer_dlist(rname, [(raddr, 64, 0)], "DRAM")
    h0 = agent.make_prepped_xfer("WRITE", lp0, [0], rp0, [0])
    _poll_done(agent, h0, agent.transfer(h0))
    h0.release()
    lp0.release()
    rp0.release()
    return time.perf_counter() - t0


def raw_batch_dlists(agent, rname: str, bsrc: list, rbatch, bsize: int):
    """Prepared descriptor lists for a batch: local tensors ``bsrc`` -> remote addresses
    ``rbatch``, ``bsize`` bytes each.  Returns (lp, rp, idx)."""
    import numpy as np

    bcount = len(bsrc)
    larr = np.array([(b.data_ptr(), bsize, 0) for b in bsrc], dtype=np.uint64)
    rarr = np.stack(
        [
            np.asarray(rbatch, dtype=np.uint64),
            np.full(bcount, bsize, np.uint64),
            np.zeros(bcount, np.uint64),
        ],
        axis=1,
    )
    lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", larr, "DRAM")
    rp = agent.prep_xfer_dlist(rname, rarr, "DRAM")
    return lp, rp, np.arange(bcount, dtype=np.int32)


def _raw_writer(peer, parent, cfg: dict) -> None:
    _apply_env(cfg)
    import torch

    agent = _nixl_agent("raw-send")
    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize, biters, bwarm = cfg["batch"]
    src = torch.empty(maxn, dtype=torch.uint8)
    src.fill_(1)
    bsrc = [torch.full((bsize,), 1, dtype=torch.uint8) for _ in range(bcount)]
    agent.register_memory(src)
    if bcount:
        agent.register_memory(bsrc)

    dbg("raw writer registered")
    msg = peer_recv(peer)
    dbg("raw writer got ready")
    assert msg[0] == "ready", msg
    _, rmd, raddr, rlen, rbatch = msg
    rname = _remote_name(agent.add_remote_agent(rmd))
    peer.send(("md", agent.get_agent_metadata()))
    peer_recv(peer)

    records: list[dict] = []
    notes: list[str] = []
    seed = 1000

    def verify(kind: str, n: int, one: Callable[[], None], fill: Callable[[int], None]) -> bool:
        nonlocal seed
        dbg(f"raw verify {kind} {n}")
        seed += 1
        peer.send(("zero", kind, n))
        peer_recv(peer)
        fill(seed)
        one()
        peer.send(("check", kind, n, seed))
        reply = peer_recv(peer)
        if not reply[1]:
            raise RuntimeError(f"raw NIXL: {kind} {size_label(n)}: bytes did not land")
        return True

    # a first transfer: lazy UCX connect happens here, not inside any timed size
    dt = raw_connect(agent, rname, src.data_ptr(), raddr)
    notes.append(f"raw NIXL first transfer (lazy connect) {1e3 * dt:.2f} ms")
    peer.send(("connected",))

    for n, iters, warm in cfg["sizes"]:
        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.data_ptr(), n, 0)], "DRAM")
        rp = agent.prep_xfer_dlist(rname, [(raddr, n, 0)], "DRAM")
        make_post, repost, rh = raw_variants(agent, lp, rp, [0])
        label = size_label(n)
        for system, fn in (("raw-nixl", make_post), ("raw-nixl-repost", repost)):
            dbg(f"raw time {system} {n}")
            times = time_loop(fn, iters, warm)
            rec = summarize(system, label, n, times)
            rec["verified"] = verify("buf", n, fn, lambda s, n=n: fill_pattern(src[:n], s))
            if system == "raw-nixl":
                rec.update(
                    raw_probe(agent, lp, rp, [0], max(1, min(iters, 200 if n <= MiB else 3)))
                )
            records.append(rec)
        rh.release()
        lp.release()
        rp.release()

    if bcount:
        n = bcount * bsize
        lp, rp, idx = raw_batch_dlists(agent, rname, bsrc, rbatch, bsize)
        make_post, repost, rh = raw_variants(agent, lp, rp, idx)
        label = f"{bcount}x{size_label(bsize)}".replace(" ", "")

        def bfill(s: int) -> None:
            for i, b in enumerate(bsrc):
                fill_pattern(b, s + i)

        for system, fn in (("raw-nixl-batch", make_post), ("raw-nixl-batch-repost", repost)):
            dbg(f"raw time {system} {n}")
            times = time_loop(fn, biters, bwarm)
            rec = summarize(system, label, n, times)
            rec["verified"] = verify("batch", n, fn, bfill)
            if system == "raw-nixl-batch":
                rec.update(raw_probe(agent, lp, rp, idx, max(1, min(biters, 3))))
            records.append(rec)
        rh.release()
        lp.release()
        rp.release()

    dbg("raw writer stop")
    peer.send(("stop",))
    bye = peer_recv(peer)
    notes.append(
        f"raw NIXL receiver progress mode '{cfg['recv_progress']}': {bye[1]} get_new_notifs() calls"
    )
    agent.remove_remote_agent(rname)
    parent.send({"records": records, "notes": notes})


def run_raw_nixl(cfg: dict, timeout: float = 600.0) -> dict:
    return run_pair(_raw_writer, _raw_receiver, cfg, timeout)


# --------------------------------------------------------------------------------------------
# torch.distributed gloo send/recv
# --------------------------------------------------------------------------------------------


def _gloo_init(cfg: dict, rank: int):
    _apply_env(cfg)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}", rank=rank, world_size=2
    )
    return dist


def _gloo_receiver(peer, cfg: dict) -> None:
    import torch

    dist = _gloo_init(cfg, 1)
    maxn = max(n for n, _, _ in cfg["sizes"])
    buf = torch.zeros(maxn, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    while True:
        msg = peer.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "size":
            _, n, count = msg
            view = buf[:n]
            for _ in range(count):
                dist.recv(view, 0)
                dist.send(ack, 0)
        elif msg[0] == "verify":
            _, n, seed = msg
            buf[:n].zero_()
            peer.send(("ok",))
            dist.recv(buf[:n], 0)
            dist.send(ack, 0)
            peer.send(("checked", check_pattern(buf[:n], seed)))
    dist.destroy_process_group()


def _gloo_writer(peer, parent, cfg: dict) -> None:
    import torch

    dist = _gloo_init(cfg, 0)
    maxn = max(n for n, _, _ in cfg["sizes"])
    src = torch.empty(maxn, dtype=torch.uint8)
    src.fill_(1)
    ack = torch.zeros(1, dtype=torch.uint8)
    records = []
    for i, (n, iters, warm) in enumerate(cfg["sizes"]):
        view = src[:n]

        def one(view=view) -> None:
            dist.send(view, 1)
            dist.recv(ack, 1)

        peer.send(("size", n, iters + warm))
        times = time_loop(one, iters, warm)
        rec = summarize("gloo", size_label(n), n, times)
        seed = 2000 + i
        peer.send(("verify", n, seed))
        peer_recv(peer)
        fill_pattern(view, seed)
        one()
        if not peer_recv(peer)[1]:
            raise RuntimeError(f"gloo {size_label(n)}: bytes did not land")
        rec["verified"] = True
        records.append(rec)
    peer.send(("stop",))
    dist.destroy_process_group()
    parent.send(
        {
            "records": records,
            "notes": ["gloo: send(data) + recv(1-byte ack) per iteration, 2 processes, loopback"],
        }
    )


def run_gloo(cfg: dict, timeout: float = 600.0) -> dict:
    cfg = dict(cfg, gloo_port=free_port())
    return run_pair(_gloo_writer, _gloo_receiver, cfg, timeout)
