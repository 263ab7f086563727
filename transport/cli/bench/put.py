"""``transport bench put``: our put and get against raw NIXL, gloo, NCCL and memcpy.

Raw NIXL and ours run INTERLEAVED on the same tensors: per (op, receivers, size), cycles of
raw-nixl, ours, raw-nixl-repost, ours (below 1 MiB a block of iterations each), every iteration
timed, so drift hits all alike; "ours" records also carry the paired ratio (median over cycles
of ours / other). The processes are pinned meanwhile where CPUs suffice (``--pin``). gloo and
NCCL follow in the same processes, memcpy in the writer alone. Every system is verified once
per configuration: destination zeroed, source filled with a fresh pattern, checked after.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch

import transport
from transport import CliError
from transport.cli.bench import _report
from transport.cli.bench._runner import Ratio, Record, Results, Timing, Turn, Workload
from transport.cli.bench._session import NOTE, Session, get_blob, put_blob
from transport.cli.bench._systems import Dist, Group, Memcpy, RawLink, RawNixl, Route, System
from transport.cli.bench._util import KiB, MiB, parse_batch, parse_size, parse_sizes
from transport.cli.bench._util import size_label as label_of

OURS, RAW, REPOST, SINGLE = "ours", "raw-nixl", "raw-nixl-repost", "ours-single"
#: how long each reader measures its CPU while idle, before anything is measured
IDLE_S = 2.0
LATENCY_MAX = 64 * KiB  # at and below: compare latency; above: bandwidth
TARGETS = {"latency": 1.3, "bandwidth": 0.95}  # ours against raw-nixl, one receiver
SIZES, SIZES_QUICK = "4K,64K,1M,16M,64M,256M,1G", "4K,1M,64M"


@dataclass(frozen=True)
class PutCase:
    """One configuration of ``bench put``: ``op`` to (or from) ``receivers`` readers, a single
    tensor or a batch (``kind``) of ``bytes`` per receiver, ``size`` its label."""

    op: str
    receivers: int
    kind: str
    size: str
    bytes: int

    def copies(self) -> int:
        return self.receivers


def _ones(count: int, size: int) -> list[torch.Tensor]:
    return [torch.ones(size, dtype=torch.uint8) for _ in range(count)]


def receiver_counts(n: int) -> list[int]:
    """1, 2, 4, .. below ``n``, then ``n``."""
    return [*(1 << i for i in range(n.bit_length()) if 1 << i < n), n]


@dataclass
class PutWorkload(Workload):
    """What one ``bench put`` run measures, fixed by :meth:`from_args`: sizes, an optional batch
    (count, bytes each), ops, receiver counts ``ks`` of ``readers``, baselines, lane counts and
    the budgets (see :class:`Timing`; ``block`` only below 1 MiB). The writer's tensors and raw
    NIXL agent live from :meth:`setup` to :meth:`close`."""

    sizes: list[int]
    batch: tuple[int, int] | None
    ops: list[str]  # "write", "read"
    ks: list[int]  # receiver counts measured
    readers: int
    baselines: list[str]
    budget_s: float = 1.5
    min_cycles: int = 5
    max_cycles: int = 100
    warm: int = 1
    block: int = 50
    dist_budget_s: float = 1.0
    memcpy_budget_s: float = 0.5
    min_iters: int = 5  # gloo, NCCL, memcpy
    timeout: float = 60.0
    pin: bool | None = None  # None: when the host has CPUs enough (bench._util.pin_layout)
    lanes: list[int] = field(default_factory=list)  # [ours, others...]; empty: the default
    notify: bool = False  # our writes carry a notification
    command = "put"
    main_phase = "raw+ours interleaved"

    @classmethod
    def from_args(cls, args: argparse.Namespace, peers: list[str] | None) -> PutWorkload:
        from transport.cli.bench import at_least, count_of, names, parse_baselines, positive

        q = args.quick
        sizes = parse_sizes(args.sizes or (SIZES_QUICK if q else SIZES))
        if args.max_size:
            sizes = [n for n in sizes if n <= parse_size(args.max_size, "--max-size")]
            if not sizes:
                raise CliError(f"--max-size {args.max_size} leaves no size to measure")
        batch = args.batch or ("100x64K" if q else "1000x64K")
        n = count_of("--receivers", args.receivers, peers, 1)
        positive("--budget", args.budget)
        at_least("--block", args.block)
        if bad := [x for x in names(args.lanes) if not x.isdigit() or not 1 <= int(x) <= 16]:
            raise CliError(f"--lanes takes counts from 1 to 16, got {bad[0]!r}")
        return cls(
            sizes=sizes,
            batch=None if batch.lower() == "none" else parse_batch(batch),
            ops=["write", "read"] if args.op == "both" else [args.op],
            ks=receiver_counts(n),
            readers=n,
            baselines=parse_baselines(args.baselines),
            budget_s=args.budget or (0.2 if q else 1.5),
            min_cycles=3 if q else 5,
            max_cycles=20 if q else 100,
            block=args.block,
            dist_budget_s=0.2 if q else 1.0,
            memcpy_budget_s=0.1 if q else 0.5,
            min_iters=3 if q else 5,
            timeout=args.timeout,
            pin=args.pin,
            lanes=list(dict.fromkeys(int(x) for x in names(args.lanes))),
            notify=args.notify,
        )

    def shapes(self) -> list[tuple[str, int]]:
        """("single", n) for every size, then ("batch", total) if a batch is measured."""
        batch = [("batch", self.batch[0] * self.batch[1])] if self.batch else []
        return [("single", n) for n in self.sizes] + batch

    def case(self, op: str, k: int, kind: str, n: int) -> PutCase:
        batch = f"{self.batch[0]}x{label_of(self.batch[1]).replace(' ', '')}" if self.batch else ""
        return PutCase(op, k, kind, batch if kind == "batch" else label_of(n), n)

    def reader_args(self) -> list[str]:
        return ["--notify"] if self.notify else []

    def expose(self, t: transport.Transport, m: dict[str, Any]) -> tuple[list[torch.Tensor], dict]:
        """``buf`` (the largest size) and the batch ``b0``..; touched, so no page faults later."""
        count, size = m["batch"] or (0, 0)
        buf, batch = torch.ones(m["max"], dtype=torch.uint8), _ones(count, size)
        t.expose_all({"buf": buf, **{f"b{j}": b for j, b in enumerate(batch)}})
        return [buf, *batch], {"buf": buf.data_ptr(), "batch": [b.data_ptr() for b in batch]}

    def select(self, spec: dict[str, Any], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs[1:] if spec["kind"] == "batch" else [xs[0][: spec["n"]]]

    def units(self) -> int:
        per_k = len(self.ks) * len(self.shapes())
        gloo = 2 * per_k if "gloo" in self.baselines else 0
        memcpy = len(self.shapes()) if "memcpy" in self.baselines else 0
        return len(self.ops) * per_k + gloo + memcpy

    # -- the writer ---------------------------------------------------------------------------

    def setup(self, s: Session, res: Results) -> None:
        self.s, self.res, self.raw = s, res, None
        self.mooncake: tuple[Any, dict[str, Any]] | None = None  # (engine, the reader's answer)
        for r, m in zip(s.readers, s.ask(s.readers, "idle", s=IDLE_S), strict=True):
            res.notes.append(
                f"{r} idle (its engine only, {IDLE_S:.0f} s): {100 * m['idle']:.2f}% "
                f"of a CPU; NIXL progress: {m['progress']}"
            )
        big, count, size = max(self.sizes), *(self.batch or (0, 0))
        copies = max(self.ks) if "read" in self.ops and max(self.ks) > 1 else 1
        self.lbuf = [torch.ones(big, dtype=torch.uint8) for _ in range(copies)]
        self.lbatch = [_ones(count, size) for _ in range(copies)]
        use_raw = "raw" in self.baselines
        s.ready = s.ask(
            s.readers, "setup", max=big, batch=list(self.batch or []) or None, raw=use_raw
        )
        for r in s.readers:
            s.t.wait_for_peer(r, timeout=60, regions=["buf", *(f"b{j}" for j in range(count))])
        local = [*self.lbuf, *(x for b in self.lbatch for x in b)]
        for x in local:
            s.t.register(x)
        if use_raw:
            self.raw = RawLink(s, local)
            for i, r in enumerate(s.readers):
                dt = self.raw.connect(i, self.lbuf[0], self.raw.blobs[i]["buf"])
                res.notes.append(f"raw NIXL: first transfer to {r} (connect) {1e3 * dt:.1f} ms")
        if "mooncake" in self.baselines:
            self._start_mooncake(s, res)
        self.torch_api: tuple[Any, dict[str, bytes]] | None = None  # (ours, the reader's)
        if "torch" in self.baselines:
            self._start_torch_api(s, res)
        for r in s.readers:
            t0 = time.perf_counter()
            s.t.put(self.lbuf[0][:64], r, "buf").wait(timeout=self.timeout)
            dt = 1e3 * (time.perf_counter() - t0)
            res.notes.append(f"ours: first put to {r} (resolve + connect) {dt:.1f} ms")

    def _start_mooncake(self, s: Session, res: Results) -> None:
        """Mooncake's engines in the writer and the first reader (skipped, with why, where its
        package does not load)."""
        from transport.cli.bench import _mooncake

        if (why := _mooncake.unavailable()) is not None:
            res.skipped["mooncake"] = why
            return
        (m,) = s.ask(s.readers[:1], "mooncake")
        here = _mooncake.address_toward(m["address"])
        self.mooncake = (_mooncake.MooncakeEngine(here, self.lbuf), m)

    def _start_torch_api(self, s: Session, res: Results) -> None:
        """torch's transport API in the writer and the first reader: torch's NIXL backend and
        ours through it (skipped, with why, where this torch has no such API)."""
        from transport.cli.bench import _torch_api

        if (why := _torch_api.unavailable()) is not None:
            res.skipped["torch"] = why
            return
        reader = s.readers[0]
        s.ask([reader], "torch-api")
        theirs = get_blob(s.t, reader, "torch-api")
        mine = _torch_api.Endpoints(self.lbuf[0])
        self.torch_api = (mine, theirs["remote"])
        mine.connect(theirs["urls"])
        put_blob(s.t, "torch-api", {"urls": mine.urls()})
        s.ask([reader], "torch-api-connect", writer=s.t.name)

    def close(self) -> None:
        if (raw := getattr(self, "raw", None)) is not None:  # as far as setup got
            raw.close()
        if (api := getattr(self, "torch_api", None)) is not None:
            api[0].close()

    def _local(self, i: int, op: str, kind: str, n: int) -> list[torch.Tensor]:
        idx = 0 if op == "write" else i
        return self.lbatch[idx] if kind == "batch" else [self.lbuf[idx][:n]]

    def _route(self, op: str, k: int, kind: str, n: int) -> Route:
        local = [self._local(i, op, kind, n) for i in range(k if op == "read" else 1)]
        return Route(self.s, self.s.readers[:k], {"kind": kind, "n": n}, op, local)

    def _ours(self, op: str, k: int, kind: str, n: int) -> Callable[[], object]:
        t, tmo, peers = self.s.t, self.timeout, self.s.readers[:k]
        key = None if kind == "batch" else "buf"
        srcs: list[Any] = [self._local(i, op, kind, n) for i in range(k)]
        # a batch is made once (Transport.batch), as a loop sending the same tensors every step
        # does: checked and signed once, a put of it does no per-tensor work
        srcs = [
            t.batch({f"b{j}": x for j, x in enumerate(xs)}) if key is None else xs[0] for xs in srcs
        ]
        if op == "write":
            to = peers[0] if k == 1 else peers
            note = NOTE if self.notify else None
            return lambda: t.put(srcs[0], to, key, notify=note).wait(tmo)
        if k == 1:
            return lambda: t.get(srcs[0], peers[0], key).wait(tmo)
        pairs = list(zip(srcs, peers, strict=True))
        return lambda: transport.wait_all([t.get(x, r, key) for x, r in pairs], tmo)

    def _with_lanes(self, lanes: int, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` run with the Transport set to ``lanes`` lanes (a setting read at each transfer)."""

        def run() -> object:
            self.s.t.lanes = lanes
            try:
                return fn()
            finally:
                self.s.t.lanes = self.lanes[0]

        return run

    def main_turns(self) -> Iterator[Turn]:
        shapes = [(op, k, *x) for op in self.ops for k in self.ks for x in self.shapes()]
        return (self.nixl_turn(*x) for x in shapes)

    def nixl_turn(self, op: str, k: int, kind: str, n: int) -> Turn:
        systems: list[System] = []
        route = self._route(op, k, kind, n)
        if self.raw is not None:
            path = self.raw.path(
                op.upper(),
                [
                    (self._local(i, op, kind, n), b["batch"] if kind == "batch" else [b["buf"]])
                    for i, b in enumerate(self.raw.blobs[:k])
                ],
            )
            probe = (200 if n <= MiB else 3) if k == 1 and n <= 64 * MiB else 0
            systems.append(RawNixl(RAW, path, route, probe=probe))
        ours = self._ours(op, k, kind, n)
        if self.lanes:
            self.s.t.lanes = self.lanes[0]
        systems.append(System(OURS, ours, route))
        if self.raw is not None:
            systems.append(RawNixl(REPOST, path, route, repost=True, owns=False))
        if kind == "batch" and n <= max(self.sizes) and (op == "write" or k == 1):
            systems.append(
                System(SINGLE, self._ours(op, k, "single", n), self._route(op, k, "single", n))
            )
        for lanes in self.lanes[1:]:
            systems.append(System(f"ours-lanes{lanes}", self._with_lanes(lanes, ours), route))
        if self.mooncake is not None and k == 1 and kind == "single":
            from transport.cli.bench._mooncake import Mooncake

            engine, peer = self.mooncake
            local = self._local(0, op, kind, n)
            systems.append(Mooncake(engine, peer["session"], op, local, [peer["buf"]], route))
            if self.notify and op == "write":
                # ours carries a notification: so does this one (its own, drained by the reader)
                systems.append(
                    Mooncake(engine, peer["session"], op, local, [peer["buf"]], route, NOTE)
                )
        if self.torch_api is not None and k == 1 and kind == "single":
            from transport.cli.bench._torch_api import BACKENDS

            endpoints, remote = self.torch_api
            for name in BACKENDS:
                systems.append(endpoints.system(name, op, n, remote[name], route))
        sched = [RAW, OURS, REPOST, OURS] if self.raw is not None else [OURS]
        sched += [x.name for x in systems if x.name not in sched]
        timing = Timing(
            self.budget_s,
            self.min_cycles,
            self.max_cycles,
            self.warm,
            self.block if kind == "single" and n < MiB else 1,
        )
        case, pairs = self.case(op, k, kind, n), [(OURS, x.name) for x in systems if x.name != OURS]
        return Turn(f"raw+ours {op} {case.size} to {k}", case, systems, timing, sched, pairs)

    def dist_turns(self, group: Group, backend: str) -> Iterator[Turn]:
        """gloo: send/recv, then broadcast; NCCL: broadcast; each with an ack per receiver."""
        dev, s = group.device, self.s
        on_dev = lambda x: x if dev.type == "cpu" else torch.ones_like(x, device=dev)  # noqa: E731
        dbuf, dbatch = on_dev(self.lbuf[0]), [on_dev(x) for x in self.lbatch[0]]
        for mode in ("p2p", "bcast") if backend == "gloo" else ("bcast",):
            name = f"{backend}-bcast" if mode == "bcast" else backend
            for k, (kind, n) in ((k, x) for k in self.ks for x in self.shapes()):
                xs = dbatch if kind == "batch" else [dbuf[:n]]
                route = Route(s, s.readers[:k], {"kind": kind, "n": n}, local=[xs], dist=True)
                timing = Timing(self.dist_budget_s, self.min_iters, 2000, 10 if n < MiB else 1)
                case = self.case("write", k, kind, n)
                system = Dist(name, group, mode, xs, route)
                yield Turn(f"{name} {case.size} to {k}", case, [system], timing)

    def memcpy_turns(self) -> Iterator[Turn]:
        self.res.notes.append(
            f"memcpy: dst.copy_(src) in the writer, {torch.get_num_threads()} "
            "thread(s) (CMA too is one copy by one thread)"
        )
        for kind, n in self.shapes():
            src = _ones(*self.batch) if kind == "batch" and self.batch else _ones(1, n)
            timing = Timing(self.memcpy_budget_s, self.min_iters, 5000, 2 if n < MiB else 1)
            case = self.case("write", 1, kind, n)
            yield Turn(f"memcpy {case.size}", case, [Memcpy(src)], timing)

    # -- the report ---------------------------------------------------------------------------

    def ratios(self, records: list[Record]) -> list[Ratio]:
        """Ours against each other system of its configuration: time (latency, <= 1 is better)
        or bandwidth (>= 1 is better)."""
        out = []
        for r in (r for r in records if r.system == OURS):
            c = r.case
            latency = c.bytes <= LATENCY_MAX and c.kind == "single"
            for o in records:
                oc = o.case
                same = (oc.receivers, oc.kind, oc.size) == (c.receivers, c.kind, c.size)
                if not same or o.system in (OURS, SINGLE):
                    continue
                if (o.family == "raw" and oc.op != c.op) or (o.family != "raw" and c.op != "write"):
                    continue  # gloo, NCCL and memcpy have no READ
                x = r.stats.median_s / o.stats.median_s
                paired = r.paired_time_ratio.get(o.system)
                if not latency:
                    x, paired = 1 / x, (None if paired is None else 1 / paired)
                target = None
                if o.system == RAW and c.receivers == 1 and c.kind == "single":
                    target = TARGETS["latency"] if latency else TARGETS["bandwidth"]
                    target = None if not latency and c.bytes < 64 * MiB else target
                ok = None if target is None else (x <= target if latency else x >= target)
                metric = "latency" if latency else "bandwidth"
                out.append(Ratio(o.system, x, paired, target, ok, case=c, metric=metric))
        return out

    def report(self, res: Results, ratios: list[Ratio], env: dict[str, Any], out: IO[str]) -> None:
        sizes = ", ".join(label_of(n) for n in self.sizes)
        batch = f"; batch {self.case('write', 1, 'batch', 0).size}" if self.batch else ""
        cpu = env["cpu"]
        _report.text(
            out,
            f"transport bench put: {sizes}{batch}; ops {'+'.join(self.ops)}; "
            f"receivers {','.join(map(str, self.ks))}; {cpu['count']} CPUs "
            f"({cpu['model']}); {_report.ucx_summary(env['ucx'])}",
        )
        blocks: dict[tuple[str, int], list[Record]] = {}
        for r in sorted(res.records, key=lambda r: r.family not in ("ours", "raw")):
            blocks.setdefault((r.case.op, r.case.receivers), []).append(r)
        for (op, k), rows in blocks.items():
            more = " (GB/s: bytes delivered to all receivers)" if k > 1 else ""
            _report.text(out, f"\n{op.upper()}, {k} receiver{'s' if k > 1 else ''}{more}")
            _report.table(
                out,
                "size|<system|median|GB/s|vs raw-nixl|vs ours|p10..p90|iters|ok",
                _sections(rows),
            )
        if targets := [x for x in ratios if x.target is not None]:
            _report.text(
                out,
                "\ntargets: ours against raw-nixl (make + post + poll + release per "
                "transfer), one receiver; ratio of medians [paired within cycles]",
            )
        for x in targets:
            rule = ("<=" if x.metric == "latency" else ">=") + f" {x.target}"
            paired = f" [{x.paired:.3f}]" if x.paired is not None else ""
            verdict = "PASS" if x.passed else "MISS"
            _report.text(
                out,
                f"  {x.case.op.upper():<5} {x.case.size:>8} {x.metric:<9} ours/raw = "
                f"{x.ratio:.3f}{paired}  (target {rule})  {verdict}",
            )
        dist = [x for x in ratios if x.vs in ("gloo", "gloo-bcast", "nccl-bcast")]
        if dist := [x for x in dist if x.case.kind == "single"]:
            _report.text(
                out,
                "\nours against torch.distributed (send/recv or broadcast, each with a "
                "1-byte ack):",
            )
        for x in dist:
            what = (
                f"{x.vs}/ours latency = {1 / x.ratio:.1f}x"
                if x.metric == "latency"
                else f"ours/{x.vs} bandwidth = {x.ratio:.2f}x"
            )
            c = x.case
            _report.text(out, f"  {c.op.upper():<5} {c.receivers} recv {c.size:>8}  {what}")

    def plot(self, records: list[Record], path: str, env: dict[str, Any]) -> None:
        fig, (bw, lat) = _report.pyplot().subplots(1, 2, figsize=(13, 5.2))
        lines: dict[tuple[str, str, int], list[Record]] = {}
        for r in (r for r in records if r.case.kind == "single" and r.system != SINGLE):
            lines.setdefault((r.system, r.case.op, r.case.receivers), []).append(r)
        sizes: set[int] = set()
        order = lambda x: (x[1] != "write", x[2], _report.rank(x[0]))  # noqa: E731
        for system, op, k in sorted(lines, key=order):
            rs = sorted(lines[system, op, k], key=lambda r: r.case.bytes)
            label = system + ("" if op == "write" else f" ({op})") + ("" if k == 1 else f" x{k}")
            style = dict(
                color=_report.COLORS.get(system),
                linestyle="-" if op == "write" else "--",
                marker="o",
                linewidth=2.2 if system == OURS else 1.4,
                label=label,
                alpha=1.0 if k == 1 else 0.6,
            )
            xs = [r.case.bytes for r in rs]
            sizes.update(xs)
            bw.plot(xs, [r.stats.gbps for r in rs], **style)
            lat.plot(xs, [r.stats.median_s * 1e6 for r in rs], **style)
        for ax in (bw, lat):
            ax.set_xscale("log", base=2)
            ax.set_xticks(
                sorted(sizes), [label_of(n).replace(" ", "") for n in sorted(sizes)], fontsize=8
            )
            ax.minorticks_off()
            ax.set_xlabel("transfer size (per receiver)")
            ax.grid(True, which="major", alpha=0.3)
        bw.set(ylabel="GB/s (median)", title="bandwidth")
        lat.set(ylabel="time per transfer (us, median)", yscale="log", title="latency")
        bw.legend(fontsize=8)
        _report.save(
            fig,
            path,
            f"transport bench put: {env['cpu']['count']} CPUs, {_report.ucx_summary(env['ucx'])}",
        )


def _sections(rows: list[Record]) -> list[list[list[str]]]:
    """A section per size: each system against raw-nixl and ours (time up to 64 KiB, then bw)."""
    by_size: dict[tuple[str, str], list[Record]] = {}
    order = lambda r: (r.case.bytes + (r.case.kind == "batch"), _report.rank(r.system))  # noqa: E731
    for r in sorted(rows, key=order):
        by_size.setdefault((r.case.kind, r.case.size), []).append(r)
    out = []
    for (kind, size), sel in by_size.items():
        refs = [next((r for r in sel if r.system == x), None) for x in (RAW, OURS)]
        latency = kind == "single" and sel[0].case.bytes <= LATENCY_MAX

        def rel(r: Record, o: Record | None, latency: bool = latency) -> str:
            x = r.stats.median_s / o.stats.median_s if o is not None and o is not r else None
            return "-" if x is None else f"{x:.2f}x time" if latency else f"{1 / x:.2f}x bw"

        out.append([[size, r.system, *_report.cells(r, *(rel(r, o) for o in refs))] for r in sel])
    return out
