"""``transport bench put``: our put and get against raw NIXL, gloo, NCCL and memcpy.

Raw NIXL and ours run INTERLEAVED in the same writer and reader processes, on the same tensors
(registered with both agents): for each (op, receivers, size) the writer runs cycles of raw-nixl,
ours, raw-nixl-repost, ours (below 1 MiB each turn is a block of iterations), every iteration
timed on its own, so the machine's drift hits every system alike. Besides the ratio of medians
each "ours" record carries the paired ratio: the median over cycles of ours / other within one
cycle. For this phase the writer is pinned to one CPU per lane and each reader to one of its own,
when the host has that many CPUs (``--pin``/``--no-pin`` decide instead).

gloo (and NCCL where every process has a GPU) then run in the same processes; memcpy last, in the
writer alone. Every system is verified once per configuration: the destination is zeroed, the
source filled with a fresh byte pattern, one transfer made and the pattern checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import transport
from transport.cli import CliError
from transport.cli.bench import _raw, report
from transport.cli.bench._control import Channel, get_blob, put_blob
from transport.cli.bench._dist import Group, close_group, open_group
from transport.cli.bench._session import (
    ReaderBase,
    nccl_unavailable,
    note_phase,
    print_notes,
    write_outputs,
    writer_session,
)
from transport.cli.bench._util import (
    MiB,
    batch_label,
    check_pattern,
    fill_pattern,
    interleave,
    paired_ratio,
    size_label,
    summarize,
    time_loop,
    unpin,
    zero_bytes,
)

OURS, RAW, REPOST, SINGLE = "ours", "raw-nixl", "raw-nixl-repost", "ours-single"


def _with_lanes(
    t: transport.Transport, lanes: int, base_lanes: int, fn: Callable[[], object]
) -> Callable[[], object]:
    """``fn`` run with the Transport set to ``lanes`` lanes (a setting read at each transfer)."""

    def run() -> object:
        t.lanes = lanes
        try:
            return fn()
        finally:
            t.lanes = base_lanes

    return run


@dataclass
class PutPlan:
    """What one ``bench put`` run measures, from its command line (:func:`put_plan`): the
    ``sizes``, an optional ``batch`` (count, bytes each), the ``ops``, the receiver counts ``ks``
    (of ``readers``), the baselines, the lane counts to compare, and the budgets: each
    configuration runs ``warm`` untimed cycles, then ``min_cycles`` to ``max_cycles`` cycles until
    ``budget_s`` has passed (a turn is ``block`` iterations for a single transfer under 1 MiB);
    gloo, NCCL and memcpy have their own budgets and ``min_iters``.

    Made alike in the writer and every reader; nothing changes it afterwards, and the writer's
    JSON records it as ``config``.
    """

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

    @property
    def max_bytes(self) -> int:
        return max(self.sizes)

    def shapes(self) -> list[tuple[str, int]]:
        """("single", n) for every size, then ("batch", total) if a batch is measured."""
        out = [("single", n) for n in self.sizes]
        if self.batch:
            out.append(("batch", self.batch[0] * self.batch[1]))
        return out

    def label(self, kind: str, n: int) -> str:
        return batch_label(*self.batch) if kind == "batch" and self.batch else size_label(n)


@dataclass
class Results:
    """What a bench run (``put`` or ``sync``) collects for its report and JSON: ``records`` (one
    per system and configuration), ``notes``, the ``skipped`` baselines with the reason, and
    ``phases`` (the CPU other processes used during each phase). Filled by the writer's main
    thread only; printed and written once the session has ended.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    phases: list[dict[str, Any]] = field(default_factory=list)


def record(system: str, family: str, op: str, k: int, kind: str, label: str, n: int,
           times: list[int], **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "system": system, "family": family, "op": op, "receivers": k, "kind": kind, "size": label,
        "bytes": n, "total_bytes": n * k, **summarize(times, n * k), "verified": False, **extra,
    }  # fmt: skip


# -- the reader ---------------------------------------------------------------------------------


class PutReader(ReaderBase):
    """Exposes ``buf`` (and ``b0``..: the batch) and serves the writer's commands."""

    def __init__(self, t: transport.Transport, saved_affinity: set[int] | None) -> None:
        super().__init__(t, saved_affinity)
        self.buf = torch.zeros(0, dtype=torch.uint8)
        self.batch: list[torch.Tensor] = []
        self.dbuf: torch.Tensor | None = None
        self.dbatch: list[torch.Tensor] = []

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any] | None]]:
        return {
            "setup": self.setup, "raw-md": self.raw_md, "zero": self.zero, "fill": self.fill,
            "check": self.check, "dist-init": self.dist_init, "dist-run": self.dist_run,
            "dist-end": self.dist_end,
        }  # fmt: skip

    def setup(self, m: dict[str, Any]) -> dict[str, Any]:
        self.buf = torch.ones(m["max"], dtype=torch.uint8)  # touched: no page faults while timed
        count, size = m["batch"] or (0, 0)
        self.batch = [torch.ones(size, dtype=torch.uint8) for _ in range(count)]
        self.t.expose_all({"buf": self.buf, **{f"b{j}": b for j, b in enumerate(self.batch)}})
        if m["raw"]:
            self.setup_raw([self.buf, *self.batch],
                           {"buf": self.buf.data_ptr(), "batch": [b.data_ptr() for b in self.batch]})  # fmt: skip
        return self.ready()

    def _targets(self, kind: str, n: int, dist: bool = False) -> list[torch.Tensor]:
        if dist and self.dbuf is not None:
            return self.dbatch if kind == "batch" else [self.dbuf[:n]]
        return self.batch if kind == "batch" else [self.buf[:n]]

    def zero(self, m: dict[str, Any]) -> dict[str, Any]:
        for x in self._targets(m["kind"], m["n"]):
            zero_bytes(x)
        return {}

    def fill(self, m: dict[str, Any]) -> dict[str, Any]:
        for j, x in enumerate(self._targets(m["kind"], m["n"])):
            fill_pattern(x, m["seed"] + j)
        return {}

    def check(self, m: dict[str, Any]) -> dict[str, Any]:
        xs = self._targets(m["kind"], m["n"], m.get("dist", False))
        return {"ok": all(check_pattern(x, m["seed"] + j) for j, x in enumerate(xs))}

    def dist_init(self, m: dict[str, Any]) -> dict[str, Any]:
        device = self.open_group(m)
        if device != "cpu":
            self.dbuf = torch.zeros(m["max"], dtype=torch.uint8, device=device)
            self.dbatch = [torch.zeros_like(b, device=device) for b in self.batch]
        return {}

    def dist_run(self, m: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None
        xs = self._targets(m["kind"], m["n"], dist=True)
        if m.get("check_seed") is not None:
            for x in xs:
                zero_bytes(x)
        for _ in range(m["count"]):
            self.group.read(m["mode"], xs, m["recv"])
        if m.get("check_seed") is not None:
            return {"ok": all(check_pattern(x, m["check_seed"] + j) for j, x in enumerate(xs))}
        return {}

    def dist_end(self, m: dict[str, Any]) -> dict[str, Any]:
        self.close_group()
        self.dbuf, self.dbatch = None, []
        return {}


# -- the writer ---------------------------------------------------------------------------------


class PutWriter:
    """Measures; ``readers`` are the names of the reader peers (already in the namespace)."""

    def __init__(self, t: transport.Transport, chan: Channel, readers: list[str], plan: PutPlan,
                 progress: Any, res: Results) -> None:  # fmt: skip
        self.t, self.chan, self.readers, self.plan, self.progress, self.res = (
            t,
            chan,
            readers,
            plan,
            progress,
            res,
        )
        self.seed = 1000
        self.agent: Any = None
        self.remote: list[dict[str, Any]] = []
        self.raw_names: list[str] = []
        kmax = max(plan.ks)
        fan_in = "read" in plan.ops and kmax > 1
        self.src = torch.ones(plan.max_bytes, dtype=torch.uint8)
        self.lbuf = [self.src] + [
            torch.ones(plan.max_bytes, dtype=torch.uint8) for _ in range(1, kmax if fan_in else 1)
        ]
        count, size = plan.batch or (0, 0)
        self.lbatch = [
            [torch.ones(size, dtype=torch.uint8) for _ in range(count)]
            for _ in range(kmax if fan_in else 1)
        ]
        self.ready: list[dict[str, Any]] = []

    # setup

    def setup(self) -> None:
        p = self.plan
        use_raw = "raw" in p.baselines
        self.ready = self.chan.ask(self.readers, "setup", max=p.max_bytes,
                                   batch=list(p.batch) if p.batch else None, raw=use_raw)  # fmt: skip
        regions = ["buf", *(f"b{j}" for j in range(p.batch[0] if p.batch else 0))]
        for r in self.readers:
            self.t.wait_for_peer(r, timeout=60, regions=regions)
        local = [x for x in self.lbuf] + [x for b in self.lbatch for x in b]
        for x in local:
            self.t.register(x)
        if use_raw:
            self.agent = _raw.new_agent(f"raw-{self.t.name}")
            self.agent.register_memory(local)
            put_blob(self.t.store, self.t.namespace, self.t.name, "raw",
                     {"md": self.agent.get_agent_metadata()})  # fmt: skip
            for r in self.readers:
                blob = get_blob(self.t.store, self.t.namespace, r, "raw", 60)
                self.remote.append(blob)
                self.raw_names.append(_raw.remote_name(self.agent.add_remote_agent(blob["md"])))
            self.chan.ask(self.readers, "raw-md", writer=self.t.name)
            for i, rname in enumerate(self.raw_names):
                dt = _raw.connect(self.agent, rname, self.src, self.remote[i]["buf"])
                self.res.notes.append(
                    f"raw NIXL: first transfer to {self.readers[i]} (connect) {1e3 * dt:.1f} ms"
                )
        for r in self.readers:
            t0 = time.perf_counter()
            self.t.put(self.src[:64], r, "buf").wait(timeout=p.timeout)
            self.res.notes.append(
                f"ours: first put to {r} (resolve + connect) {1e3 * (time.perf_counter() - t0):.1f} ms"
            )

    # the NIXL phase: raw and ours interleaved

    def _local(self, i: int, op: str, kind: str, n: int) -> list[torch.Tensor]:
        idx = 0 if op == "write" else i
        return self.lbatch[idx] if kind == "batch" else [self.lbuf[idx][:n]]

    def _fns(
        self, op: str, k: int, kind: str, n: int
    ) -> tuple[dict[str, Callable[[], object]], list[Any]]:
        p, t, peers = self.plan, self.t, self.readers[:k]
        fns: dict[str, Callable[[], object]] = {}
        paths: list[Any] = []
        if self.agent is not None:
            targets = []
            for i in range(k):
                loc = self._local(i, op, kind, n)
                if kind == "batch":
                    rem = _raw.remote_descs(self.remote[i]["batch"], [x.nbytes for x in loc])
                else:
                    rem = _raw.remote_descs([self.remote[i]["buf"]], [n])
                targets.append((self.raw_names[i], _raw.descs(loc), rem))
            path = _raw.RawPath(self.agent, op.upper(), targets)
            paths.append(path)
            fns[RAW], fns[REPOST] = path.make_post, path.repost
        tmo = p.timeout
        if kind == "batch":
            dicts = [
                {f"b{j}": x for j, x in enumerate(self._local(i, op, kind, n))} for i in range(k)
            ]
        if op == "write":
            target: str | list[str] = peers[0] if k == 1 else peers
            if kind == "batch":
                d0 = dicts[0]
                fns[OURS] = lambda: t.put(d0, target).wait(tmo)
                if n <= p.max_bytes:
                    v = self.src[:n]
                    fns[SINGLE] = lambda: t.put(v, target, "buf").wait(tmo)
            else:
                v = self.src[:n]
                fns[OURS] = lambda: t.put(v, target, "buf").wait(tmo)
        elif k == 1:
            peer = peers[0]
            if kind == "batch":
                d0 = dicts[0]
                fns[OURS] = lambda: t.get(d0, peer).wait(tmo)
                if n <= p.max_bytes:
                    v = self.src[:n]
                    fns[SINGLE] = lambda: t.get(v, peer, "buf").wait(tmo)
            else:
                v = self.src[:n]
                fns[OURS] = lambda: t.get(v, peer, "buf").wait(tmo)
        else:
            if kind == "batch":
                fns[OURS] = lambda: transport.wait_all(
                    [t.get(d, r) for d, r in zip(dicts, peers, strict=True)], tmo
                )
            else:
                views = [self.lbuf[i][:n] for i in range(k)]
                fns[OURS] = lambda: transport.wait_all(
                    [t.get(v, r, "buf") for v, r in zip(views, peers, strict=True)], tmo
                )
        if p.lanes:
            t.lanes = p.lanes[0]
            base = fns[OURS]
            for n_l in p.lanes[1:]:
                fns[f"ours-lanes{n_l}"] = _with_lanes(t, n_l, p.lanes[0], base)
        return fns, paths

    def verify(
        self, fn: Callable[[], object], op: str, k: int, kind: str, n: int, single: bool = False
    ) -> bool:
        """One transfer of fresh bytes, checked where they land."""
        self.seed += 7
        seed, peers = self.seed, self.readers[:k]
        shape = "single" if single else kind
        if op == "write":
            self.chan.ask(peers, "zero", kind=shape, n=n)
            for j, x in enumerate(self._local(0, op, shape, n)):
                fill_pattern(x, seed + j)
            fn()
            return all(m["ok"] for m in self.chan.ask(peers, "check", seed=seed, kind=shape, n=n))
        self.chan.ask(peers, "fill", per_peer=lambda i: {"seed": seed + 1000 * i}, kind=shape, n=n)
        for i in range(k):
            for x in self._local(i, op, shape, n):
                zero_bytes(x)
        fn()
        return all(
            check_pattern(x, seed + 1000 * i + j)
            for i in range(k)
            for j, x in enumerate(self._local(i, op, shape, n))
        )

    def measure(self, op: str, k: int, kind: str, n: int) -> None:
        p = self.plan
        label = p.label(kind, n)
        fns, paths = self._fns(op, k, kind, n)
        try:
            sched = [RAW, OURS, REPOST, OURS] if RAW in fns else [OURS]
            if SINGLE in fns:
                sched.append(SINGLE)
            sched += [name for name in fns if name.startswith("ours-lanes")]
            per_peer = p.batch[1] if kind == "batch" and p.batch else n
            block = p.block if per_peer < MiB and kind != "batch" else 1
            times, per_cycle = interleave(
                fns, sched, block, p.budget_s, p.min_cycles, p.max_cycles, p.warm
            )
            recs: dict[str, dict[str, Any]] = {}
            for name in dict.fromkeys(sched):
                fam = "raw" if name.startswith("raw") else "ours"
                rec = record(name, fam, op, k, kind, label, n, times[name], block=block,
                             cycles=len(per_cycle[name]))  # fmt: skip
                rec["verified"] = self.verify(fns[name], op, k, kind, n, single=name == SINGLE)
                if not rec["verified"]:
                    raise CliError(
                        f"{name} {op} {label} to {k} receiver(s): the bytes did not land"
                    )
                recs[name] = rec
            recs[OURS]["paired_time_ratio"] = {
                other: paired_ratio(per_cycle[OURS], per_cycle[other])
                for other in recs
                if other != OURS
            }
            if RAW in recs and k == 1 and n <= 64 * MiB:
                recs[RAW].update(paths[0].probe(200 if n <= MiB else 3))
            self.res.records.extend(recs.values())
        finally:
            for path in paths:
                path.close()

    # gloo / NCCL

    def dist_phase(self, backend: str, device_of: Callable[[int], int]) -> None:
        """gloo or NCCL: send/recv (gloo) and broadcast, each with an ack; ``device_of(rank)``:
        the CUDA device index each rank uses (NCCL)."""
        p, peers = self.plan, self.readers
        group = open_group(self.chan, getattr(self.t.store, "url", None), peers, backend, p.ks,
                           device_of, max=p.max_bytes)  # fmt: skip
        device = str(group.device)
        if device == "cpu":
            dbuf, dbatch = self.src, self.lbatch[0]
        else:
            dbuf = torch.ones(p.max_bytes, dtype=torch.uint8, device=device)
            dbatch = [torch.ones_like(x, device=device) for x in self.lbatch[0]]
        try:
            for mode in ("p2p", "bcast"):
                if backend == "nccl" and mode == "p2p":
                    continue
                system = f"{backend}-bcast" if mode == "bcast" else backend
                for k in p.ks:
                    for kind, n in p.shapes():
                        label = p.label(kind, n)
                        self.progress.step(f"{system} {label} to {k}")
                        xs = dbatch if kind == "batch" else [dbuf[:n]]
                        run = _DistRun(self.chan, group, peers[:k], mode, kind, n, xs)
                        warm = run(10 if n < MiB else 1)
                        per = max(statistics.median(warm), 1) / 1e9
                        times = run(int(min(2000, max(p.min_iters, p.dist_budget_s / per))))
                        self.seed += 7
                        for j, x in enumerate(xs):
                            fill_pattern(x, self.seed + j)
                        rec = record(
                            system, backend, "write", k, kind, label, n, times, device=device
                        )
                        rec["verified"] = run.verify(self.seed)
                        if not rec["verified"]:
                            raise CliError(
                                f"{system} {label} to {k} receiver(s): the bytes did not land"
                            )
                        self.res.records.append(rec)
        finally:
            close_group(self.chan, peers, group)

    # memcpy

    def memcpy_phase(self) -> None:
        p = self.plan
        self.res.notes.append(
            f"memcpy: dst.copy_(src) in the writer, {torch.get_num_threads()} thread(s) (CMA too is one copy by one thread)"
        )
        for kind, n in p.shapes():
            label = p.label(kind, n)
            self.progress.step(f"memcpy {label}")
            if kind == "batch" and p.batch:
                src = [torch.ones(p.batch[1], dtype=torch.uint8) for _ in range(p.batch[0])]
            else:
                src = [torch.ones(n, dtype=torch.uint8)]
            dst = [torch.zeros_like(x) for x in src]

            def one(src: list[torch.Tensor] = src, dst: list[torch.Tensor] = dst) -> None:
                for d, s in zip(dst, src, strict=True):
                    d.copy_(s)

            times = time_loop(one, p.memcpy_budget_s, p.min_iters, 5000, 2 if n < MiB else 1)
            self.seed += 7
            for j, x in enumerate(src):
                fill_pattern(x, self.seed + j)
            one()
            rec = record("memcpy", "memcpy", "write", 1, kind, label, n, times)
            rec["verified"] = all(check_pattern(x, self.seed + j) for j, x in enumerate(dst))
            if not rec["verified"]:
                raise CliError(f"memcpy {label}: the copy did not match")
            self.res.records.append(rec)
            del src, dst

    def close(self) -> None:
        if self.agent is not None:
            for rname in self.raw_names:
                self.agent.remove_remote_agent(rname)


class _DistRun:
    """``count`` operations of one configuration: the readers are told, then the writer times
    each of its own."""

    def __init__(self, chan: Channel, group: Group, targets: list[str], mode: str, kind: str, n: int,
                 xs: list[torch.Tensor]) -> None:  # fmt: skip
        self.chan, self.group, self.targets = chan, group, targets
        self.mode, self.kind, self.n, self.xs = mode, kind, n, xs

    def _go(self, count: int, check_seed: int | None) -> tuple[list[int], list[dict[str, Any]]]:
        k = len(self.targets)
        for r in self.targets:
            self.chan.send(r, "dist-run", mode=self.mode, recv=k, kind=self.kind, n=self.n,
                           count=count, check_seed=check_seed)  # fmt: skip
        out = []
        clock = time.perf_counter_ns
        for _ in range(count):
            t0 = clock()
            self.group.write(self.mode, self.xs, k)
            out.append(clock() - t0)
        return out, [self.chan.recv(r) for r in self.targets]

    def __call__(self, count: int) -> list[int]:
        return self._go(count, None)[0]

    def verify(self, seed: int) -> bool:
        """One operation of the bytes the caller filled with ``seed``, checked by every receiver."""
        return all(m["ok"] for m in self._go(1, seed)[1])


# -- the run -----------------------------------------------------------------------------------


def run_writer(args: argparse.Namespace, plan: Any, peers: list[str] | None) -> int:
    """``transport bench put`` as the writer: local readers, or the named peers of a store."""
    t_start = time.perf_counter()
    probe = report.start_ucx_probe()
    # memcpy with one thread, like CMA; and no torch pool threads pinned along with the main thread
    torch.set_num_threads(1)
    res = Results()
    shapes = plan.shapes()
    nixl_units = len(plan.ops) * len(plan.ks) * len(shapes)
    dist_units = 0
    if "gloo" in plan.baselines:
        dist_units += 2 * len(plan.ks) * len(shapes)
    units = nixl_units + dist_units + (len(shapes) if "memcpy" in plan.baselines else 0) + 1
    progress = report.Progress(units, report.progress_enabled(args.progress))
    progress.step("starting readers")
    try:
        with writer_session(args, "put", peers, plan.readers) as s:
            res.notes.extend(s.notes)
            w = PutWriter(s.t, s.chan, s.readers, plan, progress, res)
            try:
                w.setup()
                watch = s.watch()
                for op in plan.ops:
                    for k in plan.ks:
                        for kind, n in shapes:
                            progress.step(f"raw+ours {op} {plan.label(kind, n)} to {k}")
                            w.measure(op, k, kind, n)
                note_phase(res, "raw+ours interleaved", watch)
                unpin(s.saved_affinity)
                if "gloo" in plan.baselines:
                    watch = s.watch()
                    w.dist_phase("gloo", lambda rank: 0)
                    note_phase(res, "gloo", watch)
                if "nccl" in plan.baselines:
                    why = nccl_unavailable(w.ready, plan.readers + 1, s.local is not None)
                    if why:
                        res.skipped["nccl"] = why
                    else:
                        ndev = torch.cuda.device_count()
                        w.dist_phase("nccl", (lambda r: r % ndev) if s.local else (lambda r: 0))
                if "memcpy" in plan.baselines:
                    watch = s.watch()
                    w.memcpy_phase()
                    note_phase(res, "memcpy", watch)
            finally:
                w.close()
    finally:
        progress.close()
    total = time.perf_counter() - t_start
    ucx = report.finish_ucx_probe(probe)
    env = report.environment(ucx)
    ratios = report.put_ratios(res.records)
    out = sys.stdout
    print(f"transport bench put: {', '.join(sorted({r['size'] for r in res.records if r['kind'] == 'single'}, key=lambda s: next(r['bytes'] for r in res.records if r['size'] == s)))}"
          f"{'; batch ' + plan.label('batch', 0) if plan.batch else ''}; ops {'+'.join(plan.ops)}; "
          f"receivers {','.join(map(str, plan.ks))}; {env['cpu']['count']} CPUs ({env['cpu']['model']}); "
          f"{report.ucx_summary(ucx)}", file=out)  # fmt: skip
    report.put_table(res.records, ratios, out)
    res.notes.append(report.describe_code(env["code"]))
    print_notes(res, out)
    print(f"total {total:.1f} s", file=out)
    title = f"transport bench put: {env['cpu']['count']} CPUs, {report.ucx_summary(ucx)}"
    write_outputs(
        args,
        "put",
        plan,
        res,
        ratios,
        env,
        total,
        lambda path: report.plot_put(res.records, path, title),
    )
    bad = [r for r in res.records if not r["verified"]]
    return 1 if bad else 0
