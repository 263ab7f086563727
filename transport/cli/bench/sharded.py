"""``transport bench sync --trainer-ranks N``: a sharded trainer (N rank processes) into
generators of another layout and dtype, against what users write today.

ours: every rank's ``ShardedPublisher.publish(v)``, at once, into each generator's declared
layout (``--dest-layout full`` or ``tp2-fused``: generator g is tensor-parallel rank g % 2, with
vLLM's fused qkv_proj and gate_up_proj) and dtype (``--dest-dtype``; fp8 is e4m3 with 128x128
block scales, quantized by the ranks). gloo-gather: the baseline, each tensor gathered to rank
0 with torch.distributed (gloo), converted there, and published whole by one WeightPublisher.
ours-noconv (with a ``--dest-dtype`` other than float32): the ranks already hold the converted
values, so the same bytes move without conversion: the ratio ours / ours-noconv is what the
conversion costs. Systems alternate step by step; every generator checks every byte once at the
end against a reference built from the full weights. Memory per rank beyond its own shards:
what a system holds for good (our pool of staging buffers; the baseline's whole model on rank 0)
and the resident set sampled while it sends, above what it held before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any

import torch

from transport import CliError
from transport.store import reserve_port

GROUPS = {
    "ours": "bench-ours",
    "gloo-gather": "bench-base",
    "ours-noconv": "bench-noconv",
    "ours-rows": "bench-rows",
}
MiB = 1 << 20


@dataclass(frozen=True)
class Model:
    """A Llama-like model of ``layers`` layers of ``hidden`` (q, k, v, o, gate, up, down, norm)
    with an embedding and a head of ``vocab`` rows and a final norm."""

    hidden: int
    layers: int
    vocab: int

    @classmethod
    def sized(cls, params: int, tensors: int) -> Model:
        layers = max(1, (tensors - 3) // 8)
        hidden = max(256, round(math.sqrt(params / (12 * layers + 16)) / 256) * 256)
        return cls(hidden, layers, 8 * hidden)

    @property
    def ff(self) -> int:
        return -(-8 * self.hidden // 3 // 256) * 256

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden, self.ff
        out: dict[str, tuple[int, ...]] = {
            "embed": (self.vocab, h),
            "head": (self.vocab, h),
            "norm": (h,),
        }
        for i in range(self.layers):
            p = f"l{i}."
            out |= {
                p + "q": (h, h),
                p + "k": (h, h),
                p + "v": (h, h),
                p + "o": (h, h),
                p + "gate": (f, h),
                p + "up": (f, h),
                p + "down": (h, f),
                p + "norm": (h,),
            }
        return out

    def dims(self, shards: str = "tp") -> dict[str, int | None]:
        """Each tensor's shard dim: ``tp`` (column-parallel dim 0, row-parallel o and down dim 1)
        or ``fsdp`` (every matrix dim 0); norms replicated."""
        row = (".o", ".down") if shards == "tp" else ()
        return {
            n: None if len(s) == 1 else 1 if n.endswith(row) else 0
            for n, s in self.shapes().items()
        }

    def full(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(7)
        return {n: torch.randn(s, generator=g) for n, s in self.shapes().items()}


@dataclass(frozen=True)
class Config:
    """One run: the model, ``ranks`` trainer processes holding it as ``source_shards`` says,
    ``generators`` of ``dest_layout`` and ``dest_dtype``, ``steps`` timed versions per system."""

    model: Model
    ranks: int
    generators: int
    dest_layout: str
    dest_dtype: str
    steps: int
    timeout: float
    source_shards: str = "tp"
    strided: str = "pack"
    mode: str = "staging"

    def systems(self) -> list[str]:
        out = ["ours", "gloo-gather"]
        if self.dest_dtype != "float32":
            out.append("ours-noconv")
        if self.strided == "both":
            out.append("ours-rows")
        return out


def source_layout(c: Config) -> Any:
    from transport.weights import SourceLayout

    shapes = c.model.shapes()
    return SourceLayout.split(
        c.ranks, {n: (s, torch.float32) for n, s in shapes.items()}, c.model.dims(c.source_shards)
    )


def dest_layout(c: Config, g: int, dtype: str, quantize: bool) -> dict[str, Any]:
    """Generator ``g``'s layout: whole tensors or its TP=2 shard with fused parameters; in
    ``dtype`` (fp8: quantized with block scales when ``quantize``, else plain fp8)."""
    from transport.weights import DestTensor, fp8, full_copy, tp_shard

    src = source_layout(c)
    if c.dest_layout == "full":
        out = full_copy(src)
    else:
        r = g % 2
        out = {n: tp_shard(src, n, [n], 0, 2, r) for n in ("embed", "head")}
        out["norm"] = full_copy(src, ["norm"])["norm"]
        for i in range(c.model.layers):
            p = f"l{i}."
            out |= {
                p + "qkv_proj": tp_shard(src, p + "qkv_proj", [p + "q", p + "k", p + "v"], 0, 2, r),
                p + "o_proj": tp_shard(src, p + "o_proj", [p + "o"], 1, 2, r),
                p + "gate_up_proj": tp_shard(
                    src, p + "gate_up_proj", [p + "gate", p + "up"], 0, 2, r
                ),
                p + "down_proj": tp_shard(src, p + "down_proj", [p + "down"], 1, 2, r),
                p + "norm": full_copy(src, [p + "norm"])[p + "norm"],
            }
    if dtype == "fp8" and quantize:
        return fp8(out, block=(128, 128))
    want = torch.float8_e4m3fn if dtype == "fp8" else getattr(torch, dtype)
    return {
        n: DestTensor(d.shape, want if len(d.shape) == 2 else d.dtype, d.pieces, d.dim)
        for n, d in out.items()
    }


def full_converted(full: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """What the baseline's rank 0 publishes: the gathered tensors in ``dtype``."""
    from transport.weights.layouts import fp8_blockwise

    if dtype == "float32":
        return full
    out = {}
    for n, t in full.items():
        if t.dim() != 2:
            out[n] = t
        elif dtype == "fp8":
            out[n], out[n + "_scale"] = fp8_blockwise(t, (128, 128))
        else:
            out[n] = t.to(getattr(torch, dtype))
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The resident set sampled every millisecond while a block runs: its peak above the start."""

    def __enter__(self) -> _Peak:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _rank_main(conn: Any, c: Config, rank: int, store_url: str, gloo_port: int) -> None:
    import torch.distributed as dist

    import transport
    from transport import WeightPublisher
    from transport.weights import ShardedPublisher

    torch.set_num_threads(1)
    src = source_layout(c)
    full = c.model.full()
    mine = {
        n: full[n][tuple(slice(lo, hi) for lo, hi in t.held[rank].box(t.shape))].contiguous()
        for n, t in src.tensors.items()
    }
    del full
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=c.ranks
    )
    t = transport.Transport(f"bench-rank{rank}", store=store_url, timeout=c.timeout)
    made = time.perf_counter()
    pack = c.strided != "rows"
    ours = ShardedPublisher(t, mine, src, rank, group=GROUPS["ours"], pack_strided=pack)
    rows = None
    if "ours-rows" in c.systems():
        rows = ShardedPublisher(t, mine, src, rank, group=GROUPS["ours-rows"], pack_strided=False)
    made = time.perf_counter() - made
    noconv = None
    if c.dest_dtype != "float32":
        want = torch.float8_e4m3fn if c.dest_dtype == "fp8" else getattr(torch, c.dest_dtype)
        conv = {n: x.to(want) if x.dim() == 2 else x for n, x in mine.items()}
        from transport.weights import SourceLayout
        from transport.weights.layouts import SourceTensor

        nsrc = SourceLayout(
            src.world,
            {n: SourceTensor(s.shape, conv[n].dtype, s.held) for n, s in src.tensors.items()},
        )
        noconv = ShardedPublisher(
            t, conv, nsrc, rank, group=GROUPS["ours-noconv"], pack_strided=pack
        )
    base = None
    if rank == 0:
        zeros = {n: torch.zeros(s) for n, s in c.model.shapes().items()}
        shapes = full_converted(zeros, c.dest_dtype)
        base = WeightPublisher(t, shapes, group=GROUPS["gloo-gather"])
    versions = {k: 0 for k in GROUPS}

    def publish(pub: Any, key: str) -> dict[str, Any]:
        versions[key] += 1
        with _Peak() as peak:
            t0 = time.perf_counter()
            r = pub.publish(versions[key], timeout=c.timeout).wait(c.timeout + 30)
            took = time.perf_counter() - t0
        return {
            "s": took,
            "extra": peak.extra,
            "held": pub.pool_bytes,
            "done": r.done,
            "why": r.reasons,
        }

    def gather() -> dict[str, Any]:
        versions["gloo-gather"] += 1
        with _Peak() as peak:
            t0 = time.perf_counter()
            gathered = {}
            for n, s in src.tensors.items():
                if s.replicated:
                    gathered[n] = mine[n]
                    continue
                parts = [torch.empty_like(mine[n]) for _ in range(c.ranks)] if rank == 0 else None
                dist.gather(mine[n], parts, dst=0)
                if parts is not None:
                    dim = next(iter(s.held.values())).dim
                    gathered[n] = torch.cat(parts, dim)
            done: list[str] = []
            why: dict[str, str] = {}
            if base is not None:
                for n, x in full_converted(gathered, c.dest_dtype).items():
                    base.tensors[n].copy_(x)
                r = base.publish(versions["gloo-gather"], timeout=c.timeout).wait(c.timeout + 30)
                done, why = r.done, r.reasons
            del gathered
            dist.barrier()
            took = time.perf_counter() - t0
        held = sum(x.nbytes for x in base.tensors.values()) if base is not None else 0
        return {"s": took, "extra": peak.extra, "held": held, "done": done, "why": why}

    run: dict[str, Callable[[], dict[str, Any]]] = {
        "ours": lambda: publish(ours, "ours"),
        "gloo-gather": gather,
    }
    if noconv is not None:
        run["ours-noconv"] = lambda: publish(noconv, "ours-noconv")
    if rows is not None:
        run["ours-rows"] = lambda: publish(rows, "ours-rows")
    conn.send(("ready", made))
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            break
        conn.send(run[cmd]())
    for p in (ours, noconv, rows, base):
        if p is not None:
            p.close()
    t.close()
    dist.destroy_process_group()


def _gen_main(conn: Any, c: Config, g: int, store_url: str) -> None:
    import transport
    from transport.weights.layouts import fp8_blockwise

    torch.set_num_threads(1)
    t = transport.Transport(f"bench-gen{g}", store=store_url, timeout=c.timeout)
    subs, lives = {}, {}
    for system in c.systems():
        group = GROUPS[system]
        if system == "gloo-gather":
            zeros = {n: torch.zeros(s) for n, s in c.model.shapes().items()}
            live = {n: torch.zeros_like(x) for n, x in full_converted(zeros, c.dest_dtype).items()}
            layout = None
        else:
            layout = dest_layout(c, g, c.dest_dtype, quantize=system != "ours-noconv")
            live = {n: torch.zeros(d.shape, dtype=d.dtype) for n, d in layout.items()}
        subs[system] = transport.WeightSubscriber(t, live, group=group, layout=layout, mode=c.mode)
        lives[system] = live
    conn.send(("ready", 0.0))
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            break
        # verify: the newest version of every system, against the full weights
        full = c.model.full()
        out = {}
        for system, sub in subs.items():
            sub.apply()
            live = lives[system]
            if system == "gloo-gather":
                want = full_converted(full, c.dest_dtype)
            else:
                want = _reference(c, g, full, system != "ours-noconv", fp8_blockwise)
            out[system] = all(
                torch.equal(
                    live[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)
                )
                for n in want
            )
        conn.send(out)
    for sub in subs.values():
        sub.close()
    t.close()


def _reference(
    c: Config, g: int, full: dict[str, torch.Tensor], quantize: bool, blockwise: Any
) -> dict[str, torch.Tensor]:
    """Generator ``g``'s tensors built from the full weights in this process, tensor by tensor:
    each destination's pieces sliced out of the full tensors and concatenated (torch's cat, not
    the runs the ranks write), then converted."""
    out = {}
    for n, d in dest_layout(c, g, c.dest_dtype, quantize=False).items():
        parts = [
            full[p.source][tuple(slice(lo, hi) for lo, hi in p.take.box(full[p.source].shape))]
            for p in sorted(d.pieces, key=lambda p: p.at)
        ]
        x = torch.cat(parts, d.dim) if len(parts) > 1 else parts[0]
        if x.dim() != 2 or c.dest_dtype == "float32":
            out[n] = x
        elif c.dest_dtype == "fp8" and quantize:
            out[n], out[n + "_scale"] = blockwise(x.contiguous(), (128, 128))
        else:
            out[n] = x.to(d.dtype)
    return out


def run_sharded(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    from transport.cli.bench import _report
    from transport.cli.bench._util import fmt_time, parse_size
    from transport.store.tcp import TcpStore

    ranks, gens = args.trainer_ranks, args.generators or 2
    if ranks < 1 or gens < 1:
        raise CliError("--trainer-ranks and --generators must be at least 1")
    if args.store or args.role:
        raise CliError("--trainer-ranks runs its ranks and generators locally (no --store/--role)")
    params = parse_size(args.params or ("16M" if args.quick else "256M"), "--params")
    model = Model.sized(params, args.tensors or (50 if args.quick else 300))
    c = Config(
        model,
        ranks,
        gens,
        args.dest_layout,
        args.dest_dtype,
        args.steps or (3 if args.quick else 7),
        args.timeout,
        args.source_shards,
        args.strided,
        args.mode,
    )
    nbytes = sum(math.prod(s) * 4 for s in model.shapes().values())
    store = TcpStore("127.0.0.1", 0, hosting="yes")
    ctx = mp.get_context("spawn")
    gloo = reserve_port("127.0.0.1")  # held until the ranks are gone: rank 0 binds it late
    procs, conns = [], []
    for kind, i in [("gen", g) for g in range(gens)] + [("rank", r) for r in range(ranks)]:
        parent, child = ctx.Pipe()
        target, more = (_gen_main, ()) if kind == "gen" else (_rank_main, (gloo.port,))
        p = ctx.Process(target=target, args=(child, c, i, store.url, *more), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    gconns, rconns = conns[:gens], conns[gens:]
    times: dict[str, list[float]] = {}
    extra: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    try:
        for cn in conns:
            if not cn.poll(600):
                raise CliError("a rank or generator did not start within 600 s")
            cn.recv()
        systems = c.systems()
        for step in range(c.steps + 1):  # the first round warms up (plans, first touch)
            for system in systems:
                for cn in rconns:
                    cn.send(system)
                t0 = time.perf_counter()
                replies = [cn.recv() for cn in rconns]
                took = time.perf_counter() - t0
                done = [r["done"] for r in replies if r["done"]]
                if any(len(d) != gens for d in done):
                    raise CliError(
                        f"{system}: not every generator got the version: {replies[0]['why']}"
                    )
                if step:
                    times.setdefault(system, []).append(took)
                    extra.setdefault(system, []).append(max(r["extra"] for r in replies))
                    held[system] = max(r["held"] for r in replies)
        for cn in gconns:
            cn.send("verify")
        verified = [cn.recv() for cn in gconns]
    finally:
        for cn in conns:
            with contextlib.suppress(OSError):
                cn.send("exit")
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        store.close()
        gloo.close()
    med = {s: statistics.median(v) for s, v in times.items()}
    ok = {s: all(v[s] for v in verified) for s in med}
    label = f"{ranks} ranks ({c.source_shards} shards) -> {gens} generators ({c.dest_layout}, {c.dest_dtype})"
    _report.text(
        out,
        f"bench sync --trainer-ranks: {label}; model {nbytes / MiB:.0f} MiB float32 in "
        f"{len(model.shapes())} tensors (hidden {model.hidden}, {model.layers} layers), "
        f"{c.steps} steps, interleaved",
    )
    rows = [
        [
            s,
            fmt_time(med[s]),
            f"{nbytes / med[s] / 1e9:.3f}",
            f"{held[s] / MiB:.0f} MiB",
            f"{max(extra[s]) / MiB:.0f} MiB",
            "yes" if ok[s] else "NO",
        ]
        for s in med
    ]
    _report.table(
        out, "<system|median|source GB/s|held beyond shards|peak while sending|verified", [rows]
    )
    ratios = {"gloo-gather/ours": med["gloo-gather"] / med["ours"]}
    if "ours-noconv" in med:
        ratios["ours/ours-noconv"] = med["ours"] / med["ours-noconv"]
    if "ours-rows" in med:
        ratios["ours-rows/ours"] = med["ours-rows"] / med["ours"]
    for k, v in ratios.items():
        _report.text(out, f"  {k}: {v:.2f}x")
    if args.json:
        doc = {
            "config": {**asdict(c), "bytes": nbytes},
            "median_s": med,
            "times_s": times,
            "peak_extra_bytes": {s: max(v) for s, v in extra.items()},
            "held_bytes": held,
            "verified": ok,
            "ratios": ratios,
            "environment": _report.environment({}),
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plt = _report.pyplot()
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(med)
        colors = ["C0", "C1", "C2", "C3"][: len(names)]
        a.bar(names, [med[s] for s in names], color=colors)
        a.set_ylabel("seconds per version (median)")
        b.bar(names, [(held[s] + max(extra[s])) / MiB for s in names], color=colors)
        b.set_ylabel("MiB beyond its shards, per rank (max)")
        _report.save(fig, args.plot, label)
    return 0 if all(ok.values()) else 1
