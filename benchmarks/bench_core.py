"""Core benchmark: `transport` puts against raw NIXL, gloo and memcpy, all in one run.

    .venv/bin/python benchmarks/bench_core.py                  # full run (about 1.5 min here)
    .venv/bin/python benchmarks/bench_core.py --quick          # ~15 s, sizes up to 64 MiB
    .venv/bin/python benchmarks/bench_core.py --json out.json  # also write every number

What is measured (per-iteration wall time on the writer, MEDIAN of the timed iterations, after
warm-up; GB/s = 1e9 bytes/s):

1. 4 KiB put-and-wait latency: one-sided WRITE, the writer waits for its own completion, no
   notification.  ours (`t.put(...).wait()`) vs raw NIXL.
2. 64 MiB and 1 GiB put bandwidth: ours vs raw NIXL.
3. One put of a dict of 1000 tensors of 64 KiB (one transfer) vs one 64 MiB put (ours); raw NIXL
   doing the same 1000-descriptor transfer.
4. References at the same sizes: gloo send + 1-byte ack between 2 processes, in-process memcpy.

Raw NIXL comes in two variants (see _baselines.py): "raw-nixl" makes, posts, polls and releases a
prepared xfer per iteration (what a direct NIXL user writes: the reference for the ratios), and
"raw-nixl-repost" reposts one prepared handle (the tightest possible baseline).

Raw NIXL vs ours is measured INTERLEAVED by default (--mode interleaved): ONE writer and ONE
receiver process, each holding both a raw NIXL agent ("raw-send" / "raw-recv") and our Transport
("send" / "recv"), by default on the same tensors (registered with both agents; --separate-buffers
gives each system its own).  For each size the writer runs cycles of raw-nixl, ours,
raw-nixl-repost, ours (sizes under 1 MiB: --block iterations of each per turn), so the machine's
drift hits every system alike; every iteration is timed on its own.  Besides the ratio of medians
the report gives a paired ratio: the median over cycles of ours / raw-nixl within one cycle.
Writer and receiver are pinned to one CPU each (--no-pin to leave placement to the scheduler).
--mode separate runs raw NIXL and ours each in its own process pair, one after the other.
gloo and memcpy always run on their own.

Every two-process system is verified once per size: the receiver zeroes its destination, the
writer fills its source with a fresh pattern, transfers, and the receiver checks the pattern.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import _baselines as B  # noqa: E402  (sets NIXL_LOG_LEVEL / UCX_LOG_LEVEL before any nixl import)

B.use_tree(ROOT)  # `transport` of this checkout, also in the spawned children (they re-run this)

OURS_TIMEOUT_S = 60.0  # h.wait(timeout=...) for one put


# --------------------------------------------------------------------------------------------
# ours: the transport library's public API
# --------------------------------------------------------------------------------------------


def _ours_receiver(peer, cfg: dict) -> None:
    B._apply_env(cfg)
    import torch

    import transport

    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize = cfg["batch"][0], cfg["batch"][1]
    with transport.Transport("recv", store=cfg["store"]) as t:
        buf = torch.zeros(maxn, dtype=torch.uint8)
        t.expose("buf", buf)
        batch = {f"b{i}": torch.zeros(bsize, dtype=torch.uint8) for i in range(bcount)}
        if bcount:
            t.expose_all(batch)
        peer.send(("ready",))
        # Nothing else to do: the Transport's engine thread makes NIXL progress.
        while True:
            msg = peer.recv()
            op = msg[0]
            if op == "zero":
                _, kind, n = msg
                if kind == "batch":
                    for b in batch.values():
                        b.zero_()
                else:
                    buf[:n].zero_()
                peer.send(("ok",))
            elif op == "check":
                _, kind, n, seed = msg
                if kind == "batch":
                    ok = all(B.check_pattern(batch[f"b{i}"], seed + i) for i in range(bcount))
                else:
                    ok = B.check_pattern(buf[:n], seed)
                peer.send(("checked", ok))
            elif op == "writer-closed":
                break
            elif op == "error":  # the writer failed and reported it: nothing left to serve
                return
            else:
                raise ValueError(f"unknown command {msg!r}")
        t0 = time.perf_counter()
    peer.send(("bye", time.perf_counter() - t0))


def _ours_writer(peer, parent, cfg: dict) -> None:
    B._apply_env(cfg)
    import torch

    import transport

    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize, biters, bwarm = cfg["batch"]
    notes: list[str] = []
    records: list[dict] = []
    msg = B.peer_recv(peer)  # the receiver opened first: it hosts the embedded store
    assert msg[0] == "ready", msg

    t_open = time.perf_counter()
    t = transport.Transport(
        "send", store=cfg["store"], **({"chunk_bytes": cfg["chunk"]} if cfg.get("chunk") else {})
    )
    try:
        t.wait_for_peer("recv", timeout=30)
        notes.append(f"ours: open + wait_for_peer {1e3 * (time.perf_counter() - t_open):.1f} ms")
        src = torch.empty(maxn, dtype=torch.uint8)
        src.fill_(1)
        t.register(src)
        bsrc = {f"b{i}": torch.full((bsize,), 1, dtype=torch.uint8) for i in range(bcount)}
        for v in bsrc.values():
            t.register(v)

        t0 = time.perf_counter()
        t.put(src[:64], "recv", "buf").wait(timeout=OURS_TIMEOUT_S)
        notes.append(
            f"ours: first put (peer resolve + connect) {1e3 * (time.perf_counter() - t0):.2f} ms"
        )

        seed = 3000

        def verify(kind: str, n: int, one, fill) -> bool:
            nonlocal seed
            seed += 1
            peer.send(("zero", kind, n))
            B.peer_recv(peer)
            fill(seed)
            one()
            peer.send(("check", kind, n, seed))
            if not B.peer_recv(peer)[1]:
                raise RuntimeError(f"ours: {kind} {B.size_label(n)}: bytes did not land")
            return True

        for n, iters, warm in cfg["sizes"]:
            view = src[:n]

            def one(view=view) -> None:
                t.put(view, "recv", "buf").wait(timeout=OURS_TIMEOUT_S)

            rec = B.summarize("ours", B.size_label(n), n, B.time_loop(one, iters, warm))
            rec["verified"] = verify("buf", n, one, lambda s, view=view: B.fill_pattern(view, s))
            records.append(rec)

        if bcount:
            n = bcount * bsize

            def bone() -> None:
                t.put(bsrc, "recv").wait(timeout=OURS_TIMEOUT_S)

            def bfill(s: int) -> None:
                for i in range(bcount):
                    B.fill_pattern(bsrc[f"b{i}"], s + i)

            label = f"{bcount}x{B.size_label(bsize)}".replace(" ", "")
            rec = B.summarize("ours-batch", label, n, B.time_loop(bone, biters, bwarm))
            rec["verified"] = verify("batch", n, bone, bfill)
            records.append(rec)
    finally:
        t0 = time.perf_counter()
        t.close()
        notes.append(f"ours: writer close {1e3 * (time.perf_counter() - t0):.1f} ms")
    peer.send(("writer-closed",))
    bye = B.peer_recv(peer)
    notes.append(f"ours: receiver close {1e3 * bye[1]:.1f} ms")
    parent.send({"records": records, "notes": notes})


def ours_available() -> str | None:
    """None when `transport.Transport` can be used, else the reason it cannot."""
    try:
        import transport
    except Exception as e:  # noqa: BLE001 - any import failure means: skip ours
        return f"`import transport` failed: {type(e).__name__}: {e}"
    if not hasattr(transport, "Transport"):
        return "`transport.Transport` does not exist yet"
    return None


def code_info() -> dict[str, Any]:
    """Which `transport` code is measured: its directory and the checkout's git state."""
    info: dict[str, Any] = {"root": ROOT}
    try:
        import transport
        import transport.backends as tb

        info["transport"] = os.path.dirname(os.path.abspath(transport.__file__))
        info["backends"] = os.path.dirname(os.path.abspath(tb.__file__))
    except Exception as e:  # noqa: BLE001
        info["import_error"] = f"{type(e).__name__}: {e}"

    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    sha = git("rev-parse", "--short", "HEAD")
    info["commit"] = sha.strip() if sha else None
    if info["commit"] is not None:
        dirty = git("status", "--porcelain", "--", "transport", "backends")
        info["uncommitted"] = [ln[3:] for ln in (dirty or "").splitlines() if ln.strip()]
    return info


def _describe_code(info: dict[str, Any]) -> str:
    where = info.get("transport", info.get("import_error", "?"))
    if info.get("commit") is None:
        return f"{where} (not a git checkout)"
    dirty = info.get("uncommitted") or []
    state = f", UNCOMMITTED changes in {', '.join(dirty)}" if dirty else ", clean"
    return f"{where} (git {info['commit']}{state})"


OTHER_CPU_WARN = 0.15  # other processes' CPU use (in CPUs) above which a phase is flagged


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, CPU-seconds the machine was busy incl. steal, CPU-seconds of this process and its
    joined children); None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal
    busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return time.perf_counter(), busy, mine


def other_cpu(before: tuple[float, float, float] | None) -> float | None:
    """CPUs' worth of time used by processes other than this benchmark since ``before``."""
    after = cpu_snapshot()
    if before is None or after is None or after[0] <= before[0]:
        return None
    other = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, other) / (after[0] - before[0])


def run_ours(cfg: dict, timeout: float = 600.0) -> dict:
    cfg = dict(cfg, store=f"tcp://127.0.0.1:{B.free_port()}")
    return B.run_pair(_ours_writer, _ours_receiver, cfg, timeout)


# --------------------------------------------------------------------------------------------
# interleaved: raw NIXL and ours in ONE writer and ONE receiver process, iterations alternating
# --------------------------------------------------------------------------------------------


def interleave(
    fns: dict[str, Any], schedule: list[str], cycles: int, warm_cycles: int, block: int
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Run ``warm_cycles`` untimed and then ``cycles`` timed cycles; one cycle runs, for each name
    of ``schedule`` in turn, ``block`` iterations of ``fns[name]()``, each timed on its own.

    Returns (times_ns per name, per-cycle median ns per name): the second pairs the systems'
    iterations that ran within the same cycle (milliseconds apart), for drift-free ratios."""
    for _ in range(warm_cycles):
        for name in schedule:
            f = fns[name]
            for _ in range(block):
                f()
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {name: [] for name in schedule}
    per_cycle: dict[str, list[float]] = {name: [] for name in schedule}
    for _ in range(cycles):
        cyc: dict[str, list[int]] = {name: [] for name in schedule}
        for name in schedule:
            f = fns[name]
            out = cyc[name]
            for _ in range(block):
                t0 = clock()
                f()
                out.append(clock() - t0)
        for name, ts in cyc.items():
            times[name].extend(ts)
            per_cycle[name].append(statistics.median(ts))
    return times, per_cycle


def _schedule(ours: str, ref: str, present: set[str]) -> list[str]:
    """raw, ours, raw-repost, ours: every "ours" iteration sits between the two raw variants."""
    rep = ref + "-repost"
    if ours in present and ref in present:
        return [ref, ours, rep, ours]
    if ref in present:
        return [ref, rep]
    return [ours, ours]


def _pin(cfg: dict, role: int) -> None:
    """--pin: this process (and every thread it starts from now on) onto one CPU, the writer's
    and the receiver's different ones, so that no per-run thread placement favours either system."""
    if cfg.get("pin") and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[role % len(cpus)]})


def _inter_receiver(peer, cfg: dict) -> None:
    _pin(cfg, 1)
    B._apply_env(cfg)
    import numpy as np
    import torch

    do_raw, do_ours = "raw" in cfg["pair"], "ours" in cfg["pair"]
    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize = cfg["batch"][0], cfg["batch"][1]
    dst: dict[str, Any] = {}
    bdst: dict[str, list] = {}
    for who in ("raw", "ours"):
        if cfg["shared_buffers"] and dst:
            dst[who], bdst[who] = dst["raw"], bdst["raw"]
        else:
            dst[who] = torch.zeros(maxn, dtype=torch.uint8)
            bdst[who] = [torch.zeros(bsize, dtype=torch.uint8) for _ in range(bcount)]

    t = agent = None
    try:
        if do_ours:  # first: this process hosts the embedded store
            import transport

            t = transport.Transport("recv", store=cfg["store"])
            t.expose("buf", dst["ours"])
            if bcount:
                t.expose_all({f"b{i}": b for i, b in enumerate(bdst["ours"])})
        md = None
        if do_raw:
            agent = B._nixl_agent("raw-recv")
            agent.register_memory(dst["raw"])
            if bcount:
                agent.register_memory(bdst["raw"])
            md = agent.get_agent_metadata()
        rbatch = np.array([b.data_ptr() for b in bdst["raw"]], dtype=np.uint64)
        peer.send(("ready", md, dst["raw"].data_ptr(), rbatch))
        if do_raw:
            msg = B.peer_recv(peer)
            assert msg[0] == "md", msg
            agent.add_remote_agent(msg[1])
            peer.send(("ok",))

        def handle(msg) -> None:
            op = msg[0]
            if op == "zero":
                _, who, kind, n = msg
                if kind == "batch":
                    for b in bdst[who]:
                        b.zero_()
                else:
                    dst[who][:n].zero_()
                peer.send(("ok",))
            elif op == "check":
                _, who, kind, n, seed = msg
                if kind == "batch":
                    ok = all(B.check_pattern(b, seed + i) for i, b in enumerate(bdst[who]))
                else:
                    ok = B.check_pattern(dst[who][:n], seed)
                peer.send(("checked", ok))
            else:
                raise ValueError(f"unknown command {msg!r}")

        # The raw agent needs our progress calls; the Transport's engine thread makes its own.
        calls = B.serve_with_progress(peer, agent, cfg["recv_progress"], handle)
        if calls is None:  # the writer failed and said so
            return
        t0 = time.perf_counter()
        if t is not None:
            t.close()
        peer.send(("bye", calls, time.perf_counter() - t0))
    finally:
        if t is not None:
            t.close()


def _inter_writer(peer, parent, cfg: dict) -> None:
    _pin(cfg, 0)
    B._apply_env(cfg)
    import torch

    do_raw, do_ours = "raw" in cfg["pair"], "ours" in cfg["pair"]
    maxn = max(n for n, _, _ in cfg["sizes"])
    bcount, bsize, biters, bwarm = cfg["batch"]
    src: dict[str, Any] = {}
    bsrc: dict[str, list] = {}
    for who in ("raw", "ours"):
        if cfg["shared_buffers"] and src:
            src[who], bsrc[who] = src["raw"], bsrc["raw"]
        else:
            src[who] = torch.full((maxn,), 1, dtype=torch.uint8)
            bsrc[who] = [torch.full((bsize,), 1, dtype=torch.uint8) for _ in range(bcount)]
    bnames = [f"b{i}" for i in range(bcount)]
    notes: list[str] = []
    records: list[dict] = []
    msg = B.peer_recv(peer)  # the receiver opened first: it hosts the embedded store
    assert msg[0] == "ready", msg
    _, rmd, raddr, rbatch = msg

    t = agent = None
    rname = None
    try:
        if do_ours:
            import transport

            t_open = time.perf_counter()
            t = transport.Transport(
                "send",
                store=cfg["store"],
                **({"chunk_bytes": cfg["chunk"]} if cfg.get("chunk") else {}),
            )
            t.wait_for_peer("recv", timeout=30, regions=["buf", *bnames])
            notes.append(
                f"ours: open + wait_for_peer {1e3 * (time.perf_counter() - t_open):.1f} ms"
            )
            t.register(src["ours"])
            for v in bsrc["ours"]:
                t.register(v)
        if do_raw:
            agent = B._nixl_agent("raw-send")
            agent.register_memory(src["raw"])
            if bcount:
                agent.register_memory(bsrc["raw"])
            rname = B._remote_name(agent.add_remote_agent(rmd))
            peer.send(("md", agent.get_agent_metadata()))
            B.peer_recv(peer)
            dt = B.raw_connect(agent, rname, src["raw"].data_ptr(), raddr)
            notes.append(f"raw NIXL first transfer (lazy connect) {1e3 * dt:.2f} ms")
        if do_ours:
            t0 = time.perf_counter()
            t.put(src["ours"][:64], "recv", "buf").wait(timeout=OURS_TIMEOUT_S)
            notes.append(
                f"ours: first put (peer resolve + connect) {1e3 * (time.perf_counter() - t0):.2f} ms"
            )
        peer.send(("connected",))

        seed = 5000

        def verify(who: str, kind: str, n: int, one, fill) -> bool:
            nonlocal seed
            seed += 1
            peer.send(("zero", who, kind, n))
            B.peer_recv(peer)
            fill(who, seed)
            one()
            peer.send(("check", who, kind, n, seed))
            if not B.peer_recv(peer)[1]:
                raise RuntimeError(f"{who}: {kind} {B.size_label(n)}: bytes did not land")
            return True

        def measure(
            label, n, fns, ours, ref, iters, warm, block, kind, fill, extra=None
        ) -> dict[str, dict]:
            """Interleave, summarize and verify every system of ``fns``; ``extra``: name ->
            (fn, kind, fill) of one more system appended to each cycle."""
            extra = extra or {}
            sched = _schedule(ours, ref, set(fns)) + list(extra)
            fns = {**fns, **{k: v[0] for k, v in extra.items()}}
            cycles = -(-iters // block)
            B.dbg(f"interleaved {label}: {sched} x {cycles} cycles, block {block}")
            times, per_cycle = interleave(fns, sched, cycles, -(-warm // block), block)
            recs = {}
            for name in dict.fromkeys(sched):  # schedule order, each once
                rec = B.summarize(name, label, n, times[name], block=block, cycles=cycles)
                who = "ours" if name.startswith("ours") else "raw"
                k, fl = (extra[name][1], extra[name][2]) if name in extra else (kind, fill)
                rec["verified"] = verify(who, k, n, fns[name], fl)
                recs[name] = rec
            if ours in recs:
                recs[ours]["paired_time_ratio"] = {
                    other: statistics.median(
                        o / r for o, r in zip(per_cycle[ours], per_cycle[other], strict=True)
                    )
                    for other in recs
                    if other != ours
                }
            return recs

        for n, iters, warm in cfg["sizes"]:
            label = B.size_label(n)
            fns: dict[str, Any] = {}
            if do_raw:
                lp = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", [(src["raw"].data_ptr(), n, 0)], "DRAM"
                )
                rp = agent.prep_xfer_dlist(rname, [(raddr, n, 0)], "DRAM")
                fns["raw-nixl"], fns["raw-nixl-repost"], rh = B.raw_variants(agent, lp, rp, [0])
            if do_ours:
                view = src["ours"][:n]

                def one(view=view) -> None:
                    t.put(view, "recv", "buf").wait(timeout=OURS_TIMEOUT_S)

                fns["ours"] = one
            block = cfg["block"] if n < B.MiB else 1
            recs = measure(
                label, n, fns, "ours", "raw-nixl", iters, warm, block, "buf",
                lambda who, s, n=n: B.fill_pattern(src[who][:n], s),
            )  # fmt: skip
            if do_raw:
                k = max(1, min(iters, 200 if n <= B.MiB else 3))
                recs["raw-nixl"].update(B.raw_probe(agent, lp, rp, [0], k))
                rh.release()
                lp.release()
                rp.release()
            records.extend(recs.values())

        if bcount:
            n = bcount * bsize
            label = f"{bcount}x{B.size_label(bsize)}".replace(" ", "")
            fns = {}
            if do_raw:
                lp, rp, idx = B.raw_batch_dlists(agent, rname, bsrc["raw"], rbatch, bsize)
                fns["raw-nixl-batch"], fns["raw-nixl-batch-repost"], rh = B.raw_variants(
                    agent, lp, rp, idx
                )
            if do_ours:
                bdict = dict(zip(bnames, bsrc["ours"], strict=True))

                def bone() -> None:
                    t.put(bdict, "recv").wait(timeout=OURS_TIMEOUT_S)

                fns["ours-batch"] = bone

            def bfill(who: str, s: int) -> None:
                for i, b in enumerate(bsrc[who]):
                    B.fill_pattern(b, s + i)

            extra = {}
            if do_ours and n <= maxn:
                # the same bytes as ONE tensor, in the same cycles: batch/single without drift
                sview = src["ours"][:n]

                def sone(sview=sview) -> None:
                    t.put(sview, "recv", "buf").wait(timeout=OURS_TIMEOUT_S)

                extra["ours-single"] = (
                    sone,
                    "buf",
                    lambda who, s, n=n: B.fill_pattern(src[who][:n], s),
                )
            recs = measure(
                label,
                n,
                fns,
                "ours-batch",
                "raw-nixl-batch",
                biters,
                bwarm,
                1,
                "batch",
                bfill,
                extra,
            )
            if do_raw:
                recs["raw-nixl-batch"].update(
                    B.raw_probe(agent, lp, rp, idx, max(1, min(biters, 3)))
                )
                rh.release()
                lp.release()
                rp.release()
            records.extend(recs.values())
    finally:
        if agent is not None and rname is not None:
            agent.remove_remote_agent(rname)
        if t is not None:
            t0 = time.perf_counter()
            t.close()
            notes.append(f"ours: writer close {1e3 * (time.perf_counter() - t0):.1f} ms")
    peer.send(("stop",))
    bye = B.peer_recv(peer)
    if do_raw:
        notes.append(
            f"raw NIXL receiver progress mode '{cfg['recv_progress']}': {bye[1]} get_new_notifs() calls"
        )
    if do_ours:
        notes.append(f"ours: receiver close {1e3 * bye[2]:.1f} ms")
    parent.send({"records": records, "notes": notes})


def run_interleaved(cfg: dict, pair: list[str], timeout: float = 900.0) -> dict:
    cfg = dict(cfg, store=f"tcp://127.0.0.1:{B.free_port()}", pair=pair)
    return B.run_pair(_inter_writer, _inter_receiver, cfg, timeout)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

RAW_REF = {"ours": "raw-nixl", "ours-batch": "raw-nixl-batch"}


def _fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1.0:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.3f} s "


def _find(records: list[dict], size: str, system: str) -> dict | None:
    for r in records:
        if r["size"] == size and r["system"] == system:
            return r
    return None


def compute_ratios(records: list[dict], cfg: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def ratio(num: dict | None, den: dict | None, key: str) -> float | None:
        if num is None or den is None:
            return None
        return num[key] / den[key]

    small = B.size_label(4 * B.KiB)
    out["lat_4k_ours_over_raw"] = ratio(
        _find(records, small, "ours"), _find(records, small, "raw-nixl"), "median_s"
    )
    out["lat_4k_ours_over_raw_repost"] = ratio(
        _find(records, small, "ours"), _find(records, small, "raw-nixl-repost"), "median_s"
    )
    for n, key in ((64 * B.MiB, "64m"), (B.GiB, "1g")):
        lab = B.size_label(n)
        out[f"bw_{key}_ours_over_raw"] = ratio(
            _find(records, lab, "ours"), _find(records, lab, "raw-nixl"), "gbps"
        )
        out[f"bw_{key}_ours_over_raw_repost"] = ratio(
            _find(records, lab, "ours"), _find(records, lab, "raw-nixl-repost"), "gbps"
        )
    bcount, bsize = cfg["batch"][0], cfg["batch"][1]
    blab = f"{bcount}x{B.size_label(bsize)}".replace(" ", "")
    single = B.size_label(64 * B.MiB)  # 1000 x 64 KiB = 62.5 MiB: compared by GB/s
    out["batch_over_single_ours"] = ratio(
        _find(records, blab, "ours-batch"), _find(records, single, "ours"), "gbps"
    )
    out["batch_over_single_raw"] = ratio(
        _find(records, blab, "raw-nixl-batch"), _find(records, single, "raw-nixl"), "gbps"
    )
    out["batch_ours_over_raw"] = ratio(
        _find(records, blab, "ours-batch"), _find(records, blab, "raw-nixl-batch"), "gbps"
    )

    # interleaved mode only: median over cycles of (ours / raw-nixl) within the same cycle
    def paired(label: str, system: str, ref: str, bw: bool) -> float | None:
        r = _find(records, label, system)
        x = (r or {}).get("paired_time_ratio", {}).get(ref)
        return None if x is None else (1.0 / x if bw else x)

    out["paired_lat_4k_ours_over_raw"] = paired(small, "ours", "raw-nixl", False)
    out["paired_bw_64m_ours_over_raw"] = paired(B.size_label(64 * B.MiB), "ours", "raw-nixl", True)
    out["paired_bw_1g_ours_over_raw"] = paired(B.size_label(B.GiB), "ours", "raw-nixl", True)
    out["paired_batch_ours_over_raw"] = paired(blab, "ours-batch", "raw-nixl-batch", True)
    # ours-single: one tensor of the batch's total size, in the batch's cycles (same bytes)
    out["paired_batch_over_single_ours"] = paired(blab, "ours-batch", "ours-single", True)
    return out


def print_table(records: list[dict]) -> None:
    order = [
        "memcpy",
        "gloo",
        "raw-nixl",
        "raw-nixl-repost",
        "ours",
        "raw-nixl-batch",
        "raw-nixl-batch-repost",
        "ours-batch",
        "ours-single",
    ]
    sizes: list[str] = []
    for r in records:
        if r["size"] not in sizes:
            sizes.append(r["size"])
    # batch rows after the 64 MiB rows they are compared with
    sizes.sort(
        key=lambda s: (
            next(r["bytes"] for r in records if r["size"] == s) + (B.MiB * 2 if "x" in s else 0)
        )
    )
    hdr = f"{'size':>11} | {'system':<22} | {'median':>11} | {'GB/s':>7} | {'vs raw-nixl':>16} | {'p10..p90':>21} | {'iters':>5} | ok"
    print(hdr)
    print("-" * len(hdr))
    for s in sizes:
        rows = sorted(
            (r for r in records if r["size"] == s),
            key=lambda r: order.index(r["system"]) if r["system"] in order else 99,
        )
        latency = rows[0]["bytes"] <= 64 * B.KiB
        ref = _find(records, s, "raw-nixl-batch" if "x" in s else "raw-nixl")
        for r in rows:
            if ref is None:
                rel = "-"
            elif latency:
                rel = f"{r['median_s'] / ref['median_s']:.3f}x lat"
            else:
                rel = f"{r['gbps'] / ref['gbps']:.3f}x bw"
            spread = f"{_fmt_time(r['p10_s']).strip()}..{_fmt_time(r['p90_s']).strip()}"
            print(
                f"{s:>11} | {r['system']:<22} | {_fmt_time(r['median_s'])} | {r['gbps']:7.3f} | {rel:>16} | {spread:>21} | {r['iters']:>5} | {'yes' if r['verified'] else 'NO'}"
            )
        print("-" * len(hdr))


def merge_rounds(per_round: list[list[dict]]) -> list[dict]:
    """One record per (size, system): the median of its per-round medians."""
    if len(per_round) == 1:
        return per_round[0]
    merged: dict[tuple[str, str], dict] = {}
    rounds: dict[tuple[str, str], list[dict]] = {}
    for recs in per_round:
        for r in recs:
            rounds.setdefault((r["size"], r["system"]), []).append(r)
    for key, rs in rounds.items():
        meds = [r["median_s"] for r in rs]
        pooled = sorted(t for r in rs for t in r["times_ns"])
        rec = dict(rs[0])
        rec["times_ns"] = [t for r in rs for t in r["times_ns"]]
        rec["p10_s"] = pooled[int(0.10 * (len(pooled) - 1))] / 1e9
        rec["p90_s"] = pooled[int(0.90 * (len(pooled) - 1))] / 1e9
        rec["min_s"] = pooled[0] / 1e9
        rec["median_s"] = statistics.median(meds)
        rec["gbps"] = rec["bytes"] / rec["median_s"] / 1e9
        rec["round_medians_s"] = meds
        rec["verified"] = all(r["verified"] for r in rs)
        rec["iters"] = sum(r["iters"] for r in rs)
        if "paired_time_ratio" in rec:
            rec["paired_time_ratio"] = {
                k: statistics.median(r["paired_time_ratio"][k] for r in rs)
                for k in rec["paired_time_ratio"]
            }
        merged[key] = rec
    return list(merged.values())


def _verdict(x: float | None, target: float, le: bool) -> str:
    if x is None:
        return "n/a"
    good = x <= target if le else x >= target
    return f"{x:.3f}  {'PASS' if good else 'MISS'}"


def print_targets(ratios: dict[str, Any], cfg: dict) -> None:
    bcount, bsize = cfg["batch"][0], cfg["batch"][1]
    blab = f"{bcount}x{B.size_label(bsize)}".replace(" ", "")
    single = B.size_label(64 * B.MiB)

    def p(key: str) -> str:
        x = ratios.get("paired_" + key)
        return "" if x is None else f"; paired per cycle {x:.3f}"

    print("targets (reference: raw-nixl = make+post+poll+release per iteration; ratio of medians):")
    print(
        f"  4 KiB latency ours/raw = {_verdict(ratios['lat_4k_ours_over_raw'], 1.3, True)} "
        f"(target <= 1.3{p('lat_4k_ours_over_raw')})"
    )
    print(
        f"  64 MiB bw ours/raw = {_verdict(ratios['bw_64m_ours_over_raw'], 0.95, False)} "
        f"(target >= 0.95{p('bw_64m_ours_over_raw')})"
    )
    print(
        f"  1 GiB bw ours/raw = {_verdict(ratios['bw_1g_ours_over_raw'], 0.95, False)} "
        f"(target >= 0.95{p('bw_1g_ours_over_raw')})"
    )
    print(
        f"  batch {blab} bw / single {single} bw = {_verdict(ratios['batch_over_single_ours'], 0.8, False)} "
        f"(target >= 0.8{p('batch_over_single_ours')}"
        f"{' vs one tensor of the same bytes' if p('batch_over_single_ours') else ''})"
    )

    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    print("also:")
    print(
        f"  vs raw-nixl-repost: 4 KiB latency {f(ratios['lat_4k_ours_over_raw_repost'])}, "
        f"64 MiB bw {f(ratios['bw_64m_ours_over_raw_repost'])}, 1 GiB bw {f(ratios['bw_1g_ours_over_raw_repost'])}"
    )
    print(
        f"  batch ours/raw-batch bw = {f(ratios['batch_ours_over_raw'])}; "
        f"raw batch/single bw = {f(ratios['batch_over_single_raw'])}"
    )
    if ratios.get("paired_batch_ours_over_raw") is not None:
        print(
            f"  batch ours/raw-batch bw, paired per cycle = {f(ratios['paired_batch_ours_over_raw'])}"
        )
    if any(ratios.get(k) is not None for k in ratios if k.startswith("paired_")):
        print(
            "  (paired per cycle = median over the interleaved cycles of ours/raw-nixl within the "
            "same cycle: drift cancels)"
        )


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace) -> dict:
    if args.quick:
        plan = [(4 * B.KiB, 300, 50), (64 * B.MiB, 10, 2), (B.GiB, 3, 1)]
        batch_iters = (10, 2)
        max_size = B.parse_size(args.max_size) if args.max_size else 64 * B.MiB
    else:
        plan = [(4 * B.KiB, 2000, 200), (64 * B.MiB, 40, 4), (B.GiB, 24, 1)]
        batch_iters = (40, 4)
        max_size = B.parse_size(args.max_size) if args.max_size else B.GiB
    if args.iters_scale != 1.0:
        plan = [(n, max(3, int(i * args.iters_scale)), w) for n, i, w in plan]
        batch_iters = (max(3, int(batch_iters[0] * args.iters_scale)), batch_iters[1])
    sizes = [p for p in plan if p[0] <= max_size]
    env: dict[str, str] = {}
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
        if args.ucx_tls.split(",") == ["tcp"]:
            env["UCX_NET_DEVICES"] = os.environ.get("UCX_NET_DEVICES", "lo")
    return {
        "sizes": sizes,
        "batch": (args.batch_count, args.batch_size, *batch_iters)
        if args.batch_count
        else (0, 0, 0, 0),
        "recv_progress": args.recv_progress,
        "env": env,
        "chunk": args.chunk,
        "mode": args.mode,
        "block": args.block,
        "shared_buffers": not args.separate_buffers,
        "pin": args.pin,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts, sizes up to 64 MiB (~30 s)")
    ap.add_argument(
        "--max-size", default=None, help="largest single size, e.g. 64M (quick: 64M, else 1G)"
    )
    ap.add_argument("--json", default=None, metavar="FILE", help="write config, records and ratios")
    ap.add_argument(
        "--systems",
        default="memcpy,raw,gloo,ours",
        help="comma list out of memcpy,raw,gloo,ours (default: all)",
    )
    ap.add_argument(
        "--recv-progress",
        choices=("sleep", "tight", "none"),
        default="sleep",
        help="raw NIXL receiver: get_new_notifs() then wait <=0.5 ms on its pipe "
        "(sleep, default), in a busy loop (tight), or no NIXL calls once connected (none)",
    )
    ap.add_argument(
        "--ucx-tls",
        default=None,
        help="UCX_TLS for raw NIXL and ours (e.g. tcp); default: UCX's choice (cma)",
    )
    ap.add_argument(
        "--chunk",
        type=B.parse_size,
        default=None,
        help="our Transport's chunk_bytes (default: its own)",
    )
    ap.add_argument(
        "--mode",
        choices=("interleaved", "separate"),
        default="interleaved",
        help="raw NIXL vs ours: one writer and one receiver process holding both, iterations "
        "alternating raw, ours, raw-repost, ours (interleaved, default), or each system in its "
        "own process pair, one after the other (separate)",
    )
    ap.add_argument(
        "--block",
        type=int,
        default=50,
        help="interleaved: iterations per turn for sizes under 1 MiB (larger sizes: 1)",
    )
    ap.add_argument(
        "--separate-buffers",
        action="store_true",
        help="interleaved: raw NIXL and ours each get their own (equal-sized) buffers "
        "(default: the same tensors, registered with both agents)",
    )
    ap.add_argument("--batch-count", type=int, default=1000)
    ap.add_argument("--batch-size", type=B.parse_size, default=64 * B.KiB)
    ap.add_argument(
        "--iters-scale", type=float, default=1.0, help="multiply timed iteration counts"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every system N times in turn; report the median of the per-round medians "
        "(evens out load drift on a shared machine)",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="interleaved: pin the writer process (all its threads) to one CPU and the receiver "
        "to another (default: on; without it, where the threads land differs per run and moves "
        "the 64 MiB ratio by up to 10%%)",
    )
    args = ap.parse_args(argv)

    cfg = build_config(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    t_start = time.perf_counter()
    records: list[dict] = []
    notes: list[str] = []
    errors: dict[str, str] = {}
    print(
        f"bench_core: sizes {[B.size_label(n) for n, _, _ in cfg['sizes']]}, "
        f"batch {cfg['batch'][0]}x{B.size_label(cfg['batch'][1]) if cfg['batch'][0] else '-'}, "
        f"raw receiver progress '{cfg['recv_progress']}', env {cfg['env'] or 'UCX defaults'}, "
        f"{os.cpu_count()} cpus, raw vs ours: {cfg['mode']}"
        + (
            f" (block {cfg['block']} below 1 MiB, "
            f"{'shared' if cfg['shared_buffers'] else 'separate'} buffers)"
            if cfg["mode"] == "interleaved"
            else ""
        ),
        flush=True,
    )

    per_round: list[list[dict]] = []

    phases: list[dict[str, Any]] = []

    def take(name: str, res: dict, cpu0: tuple[float, float, float] | None = None) -> None:
        if cpu0 is not None:
            other = other_cpu(cpu0)
            if other is not None:
                phases.append({"phase": name, "round": len(per_round) + 1, "other_cpus": other})
                busy = f"; other processes used {100 * other:.0f}% of a CPU meanwhile"
                if other > OTHER_CPU_WARN:
                    busy += " (BUSY MACHINE)"
                res.setdefault("notes", []).append(f"{name}: {busy[2:]}")
        if "error" in res:
            errors[name] = res["error"]
            print(f"[{name}] FAILED:\n{res['error']}", flush=True)
            return
        records.extend(res["records"])
        tag = f"[round {len(per_round) + 1}] " if args.rounds > 1 else ""
        notes.extend(tag + n for n in res.get("notes", []))
        print(f"[{name}] done ({time.perf_counter() - t_start:.1f} s)", flush=True)

    for name in systems:
        if name not in ("memcpy", "raw", "gloo", "ours"):
            ap.error(f"unknown system {name!r}")
    if "ours" in systems:
        why = ours_available()
        if why:
            errors["ours"] = f"skipped: {why}"
            print(f"[ours] SKIPPED: {why}", flush=True)
            systems = [s for s in systems if s != "ours"]

    code = code_info() if "ours" in systems else {}
    if code:
        print(f"ours: transport from {_describe_code(code)}", flush=True)
        notes.append(f"ours: transport from {_describe_code(code)}")
        if code.get("uncommitted"):
            print(
                "  WARNING: edits in progress change what 'ours' is between (and within) runs; "
                "see benchmarks/README.md for measuring a commit",
                flush=True,
            )

    pair = [s for s in ("raw", "ours") if s in systems]
    for rnd in range(args.rounds):
        records = []
        if args.rounds > 1:
            print(f"-- round {rnd + 1}/{args.rounds}", flush=True)
        paired_done = False
        for name in systems:
            cpu0 = cpu_snapshot()
            if args.mode == "interleaved" and name in pair:
                if not paired_done:
                    take("+".join(pair) + " interleaved", run_interleaved(cfg, pair), cpu0)
                    paired_done = True
            elif name == "memcpy":
                try:
                    take(name, B.run_memcpy(cfg), cpu0)
                except Exception as e:  # noqa: BLE001
                    take(name, {"error": f"{type(e).__name__}: {e}"})
            elif name == "raw":
                take(name, B.run_raw_nixl(cfg), cpu0)
            elif name == "gloo":
                take(name, B.run_gloo(cfg), cpu0)
            elif name == "ours":
                take(name, run_ours(cfg), cpu0)
        per_round.append(records)
    records = merge_rounds(per_round)

    print()
    if args.rounds > 1:
        print(f"median = median of the {args.rounds} per-round medians; p10..p90 over all rounds")
    print_table(records)
    ratios = compute_ratios(records, cfg)
    print_targets(ratios, cfg)
    for r in records:
        if "post_returned_done" in r:
            notes.append(
                f"{r['system']} {r['size']}: transfer() returned DONE at once in "
                f"{100 * r['post_returned_done']:.0f}% of posts, "
                f"{r['polls_per_xfer']:.1f} check_xfer_state polls per transfer; median "
                f"make_prepped_xfer {_fmt_time(r['make_median_s']).strip()}, "
                f"transfer() {_fmt_time(r['transfer_call_median_s']).strip()}, "
                f"release() {_fmt_time(r['release_median_s']).strip()}"
            )
    if notes:
        print("notes:")
        for n in notes:
            print(f"  {n}")
    if errors:
        print("errors:")
        for k, v in errors.items():
            print(f"  {k}: {v.strip().splitlines()[-1] if v.strip() else v}")
    busy = [p for p in phases if p["other_cpus"] > OTHER_CPU_WARN]
    if busy:
        print(
            "WARNING: other processes were using the CPUs during "
            + ", ".join(f"{p['phase']} ({100 * p['other_cpus']:.0f}% of a CPU)" for p in busy)
            + ": on this small machine that moves the ratios (ours' engine thread sleeps and "
            "wakes between parts, a raw post does not); rerun when the machine is quiet"
        )
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {**cfg, "systems": systems, "quick": args.quick},
                    "host": {
                        "cpus": os.cpu_count(),
                        "platform": platform.platform(),
                        "python": platform.python_version(),
                    },
                    "code": code,
                    "phases": phases,
                    "records": records,
                    "ratios": ratios,
                    "notes": notes,
                    "errors": errors,
                    "total_s": total,
                },
                f,
                indent=2,
            )
    bad = [r for r in records if not r["verified"]]
    return 1 if bad or any(not v.startswith("skipped") for v in errors.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
