"""``transport bench sync``: one trainer publishes a synthetic model's weights to N generators.

* ours: ``WeightPublisher.publish(v).wait()`` to every ``WeightSubscriber`` (staging or in place);
  ``ours-chain`` and ``ours-tree`` are the same with the generators relaying (``--fanout``);
* raw-nixl: the same tensors (one descriptor each) written straight into every generator's live
  tensors with raw NIXL, one transfer per generator with a notification, all posted then polled;
* gloo-bcast / nccl-bcast: ``broadcast`` of every tensor from the trainer, then a 1-byte ack from
  each generator;
* memcpy: the state dict copied once per generator inside the trainer (one thread).

Raw NIXL and ours alternate step by step in the same processes (paired ratio per step); the
others run after them. Every system is verified once: fresh bytes in every tensor, one sync, and
each generator checks every tensor it holds (ours: after ``apply()``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import transport
from transport.cli import CliError
from transport.cli.bench import _raw, report
from transport.cli.bench._control import Channel, get_blob, put_blob
from transport.cli.bench._dist import as_bytes, close_group, open_group
from transport.cli.bench._session import (
    ReaderBase,
    nccl_unavailable,
    note_phase,
    print_notes,
    write_outputs,
    writer_session,
)
from transport.cli.bench._util import (
    check_pattern,
    fill_pattern,
    fmt_time,
    human_bytes,
    interleave,
    paired_ratio,
    parse_size,
    summarize,
    time_loop,
    unpin,
    zero_bytes,
)
from transport.weights._messages import MAX_DEGREE
from transport.weights.publisher import FANOUTS

GROUP = "bench"
ROLES_IN_LAYER = ["q", "k", "v", "o", "up", "down", "norm1", "norm2"]
WEIGHTS = [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 1 / 256, 1 / 256]
TARGETS = {"ours/raw": 1.25, "gloo/ours": 1.5}


@dataclass
class SyncPlan:
    """What one ``bench sync`` run measures, from its command line: the synthetic state dict
    (``params`` elements in ``tensors`` tensors of ``dtypes``, laid out by :func:`make_layout`),
    the ``generators``, ``steps`` timed syncs per system, the subscribers' ``mode``, the
    ``fanouts`` and tree ``degree``, and the baselines.

    :func:`sync_plan` makes it in the writer and in every reader (local readers get the layout
    flags from :func:`reader_args`, so both sides build the same tensors); nothing changes it
    afterwards, and the writer's JSON records it as ``config``.
    """

    params: int
    tensors: int
    dtypes: list[str]
    generators: int
    steps: int
    mode: str
    baselines: list[str]
    timeout: float = 120.0
    pin: bool | None = None  # None: when the host has CPUs enough (bench._util.pin_layout)
    fanouts: list[str] = field(default_factory=lambda: ["direct"])
    degree: int = 2
    layout: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n * _dtype(d).itemsize for _, n, d in self.layout)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CliError(
            f"unknown dtype {name!r}; use torch's names, e.g. float32, bfloat16, float16, int8"
        )
    return dt


def make_layout(params: int, tensors: int, dtypes: list[str]) -> list[tuple[str, int, str]]:
    """A transformer-like state dict: per layer q, k, v, o (1 unit each), up, down (4 each) and two
    small norms; ``params`` elements in ``tensors`` tensors, each a multiple of 64 elements."""
    w = [WEIGHTS[i % len(WEIGHTS)] for i in range(tensors)]
    total = sum(w)
    sizes = [max(64, int(params * x / total) // 64 * 64) for x in w]
    sizes[max(range(tensors), key=lambda i: w[i])] += params - sum(sizes)
    if min(sizes) < 1:
        raise CliError(
            f"--params {params} is too small for {tensors} tensors; give at least {64 * tensors}"
        )
    return [
        (
            f"layers.{i // len(ROLES_IN_LAYER)}.{ROLES_IN_LAYER[i % len(ROLES_IN_LAYER)]}",
            n,
            dtypes[i % len(dtypes)],
        )
        for i, n in enumerate(sizes)
    ]


def make_tensors(
    layout: list[tuple[str, int, str]], device: str = "cpu"
) -> dict[str, torch.Tensor]:
    return {name: torch.ones(n, dtype=_dtype(d), device=device) for name, n, d in layout}


def sync_plan(args: argparse.Namespace, peers: list[str] | None) -> SyncPlan:
    from transport.cli.bench import parse_baselines

    quick = args.quick
    params = parse_size(args.params or ("16M" if quick else "256M"), "--params")
    tensors = args.tensors if args.tensors is not None else (50 if quick else 300)
    gens = args.generators
    if peers:
        if gens is not None and gens != len(peers):
            raise CliError(f"--generators {gens} does not match the {len(peers)} names of --peers")
        gens = len(peers)
    gens = 2 if gens is None else gens
    steps = args.steps if args.steps is not None else (3 if quick else 10)
    for name, v in (("--tensors", tensors), ("--generators", gens), ("--steps", steps)):
        if v < 1:
            raise CliError(f"{name} must be at least 1, got {v}")
    if args.timeout <= 0:
        raise CliError(f"--timeout must be positive, got {args.timeout}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        raise CliError("--dtypes is empty; give e.g. float32 or bfloat16,float32")
    for d in dtypes:
        _dtype(d)
    if params < 64 * tensors:
        raise CliError(
            f"--params {args.params} is too small for {tensors} tensors; give at least {64 * tensors}"
        )
    fanouts = list(dict.fromkeys(f.strip() for f in args.fanout.split(",") if f.strip()))
    for f in fanouts:
        if f not in FANOUTS:
            raise CliError(f"unknown --fanout {f!r}; use a comma list of {', '.join(FANOUTS)}")
    if not fanouts:
        raise CliError(f"--fanout is empty; give e.g. direct,chain ({', '.join(FANOUTS)})")
    if args.mode == "inplace" and fanouts != ["direct"]:
        raise CliError(
            "relays forward from their staging slots: --fanout chain or tree needs --mode staging"
        )
    if not 1 <= args.degree <= MAX_DEGREE:
        raise CliError(f"--degree must be from 1 to {MAX_DEGREE}, got {args.degree}")
    plan = SyncPlan(params, tensors, dtypes, gens, steps, args.mode, parse_baselines(args.baselines),
                    timeout=args.timeout, pin=args.pin, fanouts=fanouts,
                    degree=args.degree)  # fmt: skip
    plan.layout = make_layout(params, tensors, dtypes)
    return plan


def reader_args(plan: SyncPlan) -> list[str]:
    """The flags a local generator needs to build the same layout."""
    return ["--params", str(plan.params), "--tensors", str(plan.tensors), "--dtypes",
            ",".join(plan.dtypes), "--mode", plan.mode]  # fmt: skip


# -- the generator (reader) ---------------------------------------------------------------------


class SyncReader(ReaderBase):
    """A generator: subscribes at once (the trainer's first contact must find its regions), with
    the layout of its own command line, which must match the trainer's."""

    def __init__(
        self, t: transport.Transport, saved_affinity: set[int] | None, plan: SyncPlan
    ) -> None:
        super().__init__(t, saved_affinity)
        self.live = make_tensors(plan.layout)
        self.sub = transport.WeightSubscriber(self.t, self.live, group=GROUP, mode=plan.mode)
        if plan.mode == "staging":
            for slot in self.sub.staging:  # touch them now, not inside a timed step
                for x in slot.values():
                    zero_bytes(x)
        self.dlive: list[torch.Tensor] = []

    def handlers(self) -> dict[str, Any]:
        return {
            "setup": self.setup, "raw-md": self.raw_md, "zero": self.zero, "check": self.check,
            "check-ours": self.check_ours, "dist-init": self.dist_init, "dist-run": self.dist_run,
            "dist-end": self.dist_end,
        }  # fmt: skip

    def setup(self, m: dict[str, Any]) -> dict[str, Any]:
        if m["raw"]:
            self.setup_raw(
                list(self.live.values()), {"addrs": [x.data_ptr() for x in self.live.values()]}
            )
        return self.ready()

    def _check(self, tensors: list[torch.Tensor], seed: int) -> bool:
        return all(check_pattern(x, seed + j) for j, x in enumerate(tensors))

    def zero(self, m: dict[str, Any]) -> dict[str, Any]:
        for x in self.dlive if m.get("dist") and self.dlive else self.live.values():
            zero_bytes(x)
        return {}

    def check(self, m: dict[str, Any]) -> dict[str, Any]:
        xs = self.dlive if m.get("dist") and self.dlive else list(self.live.values())
        return {"ok": self._check(xs, m["seed"])}

    def check_ours(self, m: dict[str, Any]) -> dict[str, Any]:
        if self.sub.mode == "staging":  # apply() must bring every byte (in place: already there)
            for x in self.live.values():
                zero_bytes(x)
        self.sub.wait_for_version(m["version"], timeout=60)
        t0 = time.perf_counter()
        applied = self.sub.apply()
        dt = time.perf_counter() - t0
        ok = applied == m["version"] and self._check(list(self.live.values()), m["seed"])
        return {"ok": ok, "apply_s": dt if self.sub.mode == "staging" else None}

    def dist_init(self, m: dict[str, Any]) -> dict[str, Any]:
        device = self.open_group(m)
        if device == "cpu":
            self.dlive = [as_bytes(x) for x in self.live.values()]
        else:
            self.dlive = [as_bytes(torch.zeros_like(x, device=device)) for x in self.live.values()]
        return {}

    def dist_run(self, m: dict[str, Any]) -> dict[str, Any]:
        assert self.group is not None
        for _ in range(m["count"]):
            self.group.read("bcast", self.dlive, m["recv"])
        return {}

    def dist_end(self, m: dict[str, Any]) -> dict[str, Any]:
        self.close_group()
        self.dlive = []
        return {}

    def close(self) -> None:
        self.sub.close()
        super().close()


# -- the trainer (writer) -----------------------------------------------------------------------


class SyncWriter:
    """The trainer's side of ``bench sync``, on the writer's main thread inside a
    :func:`writer_session`: it owns the state dict, the WeightPublisher, the raw NIXL agent and
    path (when raw is a baseline) and the version counter.

    Order: :meth:`setup` (every generator has joined the group; raw NIXL connected), then
    :meth:`measure` (ours and raw interleaved, then each system verified once with fresh bytes),
    the baseline phases, and :meth:`close` in any case. Records and notes go to ``res``; a sync
    that misses a generator, or bytes that do not arrive intact, raise CliError.
    """

    def __init__(self, t: transport.Transport, chan: Channel, readers: list[str], plan: SyncPlan,
                 res: Any) -> None:  # fmt: skip
        self.t, self.chan, self.readers, self.plan, self.res = t, chan, readers, plan, res
        self.sd = make_tensors(plan.layout)
        self.tensors = list(self.sd.values())
        self.pub: transport.WeightPublisher | None = None
        self.agent: Any = None
        self.raw_names: list[str] = []
        self.path: _raw.RawPath | None = None
        self.version = 0
        self.seed = 7000
        self.ready: list[dict[str, Any]] = []

    def setup(self, wait_s: float) -> None:
        p = self.plan
        use_raw = "raw" in p.baselines
        self.pub = transport.WeightPublisher(self.t, self.sd, group=GROUP)
        end = time.monotonic() + wait_s
        while len(self.pub.subscribers()) < len(self.readers):
            problems = self.pub.refresh()
            if problems:
                raise CliError("; ".join(f"{n}: {why}" for n, why in problems.items()))
            if time.monotonic() > end:
                raise CliError(f"the generators did not join group {GROUP!r} within {wait_s:.0f} s "
                               f"(joined: {self.pub.subscribers()})")  # fmt: skip
            time.sleep(0.02)
        self.ready = self.chan.ask(self.readers, "setup", raw=use_raw)
        if use_raw:
            self.agent = _raw.new_agent(f"raw-{self.t.name}")
            self.agent.register_memory(self.tensors)
            put_blob(
                self.t.store,
                self.t.namespace,
                self.t.name,
                "raw",
                {"md": self.agent.get_agent_metadata()},
            )
            targets = []
            local = _raw.descs(self.tensors)
            for r in self.readers:
                blob = get_blob(self.t.store, self.t.namespace, r, "raw", 60)
                rname = _raw.remote_name(self.agent.add_remote_agent(blob["md"]))
                self.raw_names.append(rname)
                targets.append(
                    (
                        rname,
                        local,
                        _raw.remote_descs(blob["addrs"], [x.nbytes for x in self.tensors]),
                    )
                )
            self.chan.ask(self.readers, "raw-md", writer=self.t.name)
            for rname, blob_addrs in zip(self.raw_names, targets, strict=True):
                _raw.connect(self.agent, rname, self.tensors[0], int(blob_addrs[2][0][0]))
            self.path = _raw.RawPath(self.agent, "WRITE", targets, notif=b"transport-bench-sync")

    def ours_step(self, fanout: str = "direct") -> None:
        assert self.pub is not None
        self.pub.fanout = fanout
        self.version += 1
        r = self.pub.publish(self.version, timeout=self.plan.timeout).wait(self.plan.timeout)
        if len(r.done) != len(self.readers):
            raise CliError(
                f"version {self.version} did not reach every generator: {r.status} {r.reasons}"
            )

    def _fill(self, tensors: list[torch.Tensor]) -> int:
        self.seed += 11
        for j, x in enumerate(tensors):
            fill_pattern(x, self.seed + j)
        return self.seed

    def measure(self) -> None:
        p = self.plan
        fns: dict[str, Any] = {}
        for f in p.fanouts:
            fns[system_of(f)] = lambda f=f: self.ours_step(f)
        sched = list(fns)
        if self.path is not None:
            fns["raw-nixl"] = self.path.make_post
            sched = ["raw-nixl", *sched]
        assert self.pub is not None
        self.pub.degree = p.degree
        warm = 2 if p.mode == "staging" else 1  # every staging slot written once
        times, per_cycle = interleave(fns, sched, 1, 0.0, p.steps, p.steps, warm)
        recs = {
            name: self._record(name, "raw" if name == "raw-nixl" else "ours", times[name])
            for name in sched
        }
        for f in p.fanouts:
            recs[system_of(f)]["fanout"] = f
            recs[system_of(f)]["trainer_bytes"] = p.nbytes * trainer_sends(f, p)
        if self.path is not None:
            seed = self._fill(self.tensors)
            self.chan.ask(self.readers, "zero")
            self.path.make_post()
            recs["raw-nixl"]["verified"] = all(
                m["ok"] for m in self.chan.ask(self.readers, "check", seed=seed)
            )
        for f in p.fanouts:
            rec = recs[system_of(f)]
            if self.path is not None:
                rec["paired_time_ratio"] = {
                    "raw-nixl": paired_ratio(per_cycle[system_of(f)], per_cycle["raw-nixl"])
                }
            if f != "direct" and "ours" in per_cycle:
                rec["paired_time_ratio"] = {
                    **rec.get("paired_time_ratio", {}),
                    "ours": paired_ratio(per_cycle[system_of(f)], per_cycle["ours"]),
                }
            seed = self._fill(self.tensors)
            self.ours_step(f)
            replies = self.chan.ask(self.readers, "check-ours", version=self.version, seed=seed)
            rec["verified"] = all(m["ok"] for m in replies)
        if p.fanouts != ["direct"]:
            self.res.notes.append(
                "relayed fan-out (ours-chain, ours-tree): the trainer sends each version "
                + ", ".join(f"{f}: {trainer_sends(f, p)}x" for f in p.fanouts)
                + f" (tree degree {p.degree}); relays forward each 32 MiB segment as it lands"
            )
        applies = [m["apply_s"] for m in replies if m.get("apply_s") is not None]
        if applies:
            recs[system_of(p.fanouts[-1])]["apply_s"] = statistics.median(applies)
            self.res.notes.append(
                f"ours: a generator's apply() (staging -> live copy, off the trainer's path) took {fmt_time(statistics.median(applies))}"
            )
        for r in recs.values():
            if not r["verified"]:
                raise CliError(f"{r['system']}: the weights did not arrive intact")
        self.res.records.extend(recs.values())

    def _record(self, system: str, family: str, times: list[int], **extra: Any) -> dict[str, Any]:
        p = self.plan
        return {
            "system": system, "family": family, "generators": p.generators, "tensors": p.tensors,
            "bytes": p.nbytes, "total_bytes": p.nbytes * p.generators,
            **summarize(times, p.nbytes * p.generators), "verified": False, **extra,
        }  # fmt: skip

    def dist_phase(self, backend: str, device_of: Any) -> None:
        p, peers = self.plan, self.readers
        group = open_group(
            self.chan, getattr(self.t.store, "url", None), peers, backend, [len(peers)], device_of
        )
        try:
            if str(group.device) == "cpu":
                xs = [as_bytes(x) for x in self.tensors]
            else:
                xs = [as_bytes(x.to(group.device)) for x in self.tensors]

            def run(count: int) -> list[int]:
                for r in peers:
                    self.chan.send(r, "dist-run", count=count, recv=len(peers))
                out = []
                for _ in range(count):
                    t0 = time.perf_counter_ns()
                    group.write("bcast", xs, len(peers))
                    out.append(time.perf_counter_ns() - t0)
                for r in peers:
                    self.chan.recv(r)
                return out

            run(1)
            times = run(p.steps)
            rec = self._record(f"{backend}-bcast", backend, times, device=str(group.device))
            self.chan.ask(peers, "zero", dist=True)
            seed = self._fill(xs)
            run(1)
            rec["verified"] = all(
                m["ok"] for m in self.chan.ask(peers, "check", seed=seed, dist=True)
            )
            if not rec["verified"]:
                raise CliError(f"{backend}: the weights did not arrive intact")
            self.res.records.append(rec)
        finally:
            close_group(self.chan, peers, group)

    def memcpy_phase(self) -> None:
        p = self.plan
        dst = [torch.empty_like(x) for x in self.tensors]

        def one() -> None:
            for _ in range(p.generators):
                for d, s in zip(dst, self.tensors, strict=True):
                    d.copy_(s)

        times = time_loop(one, 0.0, p.steps, p.steps, 1)
        rec = self._record("memcpy", "memcpy", times)
        seed = self._fill(self.tensors)
        one()
        rec["verified"] = all(check_pattern(x, seed + j) for j, x in enumerate(dst))
        self.res.records.append(rec)
        self.res.notes.append(
            f"memcpy: the state dict copied {p.generators} time(s) in the trainer, one thread"
        )

    def close(self) -> None:
        if self.path is not None:
            self.path.close()
        if self.agent is not None:
            for rname in self.raw_names:
                self.agent.remove_remote_agent(rname)
        if self.pub is not None:
            self.pub.close()


def system_of(fanout: str) -> str:
    return "ours" if fanout == "direct" else f"ours-{fanout}"


def trainer_sends(fanout: str, plan: SyncPlan) -> int:
    """How many copies of the state dict leave the trainer per sync."""
    n = plan.generators
    return n if fanout == "direct" else min(n, 1 if fanout == "chain" else plan.degree)


# -- report ---------------------------------------------------------------------------------------


def ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = report.find(records, system="ours")
    out: list[dict[str, Any]] = []
    if ours is None:
        ours = next((r for r in records if r["family"] == "ours"), None)
        if ours is None:
            return out
    for o in records:
        if o is ours:
            continue
        if o["family"] == "ours":  # a relayed fan-out against direct
            x = o["median_s"] / ours["median_s"]
            out.append({"name": f"{o['system']}/{ours['system']} time", "vs": ours["system"],
                        "ratio": x, "paired": o.get("paired_time_ratio", {}).get("ours"),
                        "target": None, "pass": None})  # fmt: skip
        elif o["system"] == "raw-nixl":
            x = ours["median_s"] / o["median_s"]
            out.append({"name": "ours/raw time", "vs": "raw-nixl", "ratio": x,
                        "paired": ours.get("paired_time_ratio", {}).get("raw-nixl"),
                        "target": TARGETS["ours/raw"], "pass": x <= TARGETS["ours/raw"]})  # fmt: skip
        else:
            target = TARGETS["gloo/ours"] if o["system"] == "gloo-bcast" else None
            # the broadcast against every fan-out of ours (a relayed one too)
            for r in [ours] + [r for r in records if r["family"] == "ours" and r is not ours]:
                x = o["median_s"] / r["median_s"]
                out.append({"name": f"{o['system']}/{r['system']} time", "vs": o["system"],
                            "ratio": x, "paired": None, "target": target,
                            "pass": None if target is None else x >= target})  # fmt: skip
    return out


def print_table(
    plan: SyncPlan, records: list[dict[str, Any]], rs: list[dict[str, Any]], out: Any
) -> None:
    dts = ",".join(dict.fromkeys(plan.dtypes))
    gens = f"{plan.generators} generator{'s' if plan.generators > 1 else ''}"
    print(f"\nweight sync: {plan.params:,} parameters ({human_bytes(plan.nbytes)} "
          f"of {dts}) in {plan.tensors} tensors to {gens}, {plan.mode} mode; "
          f"median of {plan.steps} syncs (GB/s: bytes delivered to all generators)", file=out)  # fmt: skip
    hdr = f"{'system':<12} {'per sync':>10} {'GB/s':>7} {'time/ours':>9} {'p10..p90':>21} {'steps':>5}  ok"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    ours = report.find(records, system="ours")
    order = ["memcpy", "gloo-bcast", "nccl-bcast", "raw-nixl", "ours", "ours-chain", "ours-tree"]
    for r in sorted(records, key=lambda r: order.index(r["system"]) if r["system"] in order else 9):
        rel = "-" if ours is None or r is ours else f"{r['median_s'] / ours['median_s']:.2f}x"
        spread = f"{fmt_time(r['p10_s'])}..{fmt_time(r['p90_s'])}"
        print(f"{r['system']:<12} {fmt_time(r['median_s']):>10} {r['gbps']:7.3f} {rel:>9} {spread:>21} "
              f"{r['iters']:>5}  {'yes' if r['verified'] else 'NO'}", file=out)  # fmt: skip
    if rs:
        print("\nratios (time per sync; [paired step by step]):", file=out)
        for x in rs:
            tgt = ""
            if x["target"] is not None:
                rule = "<=" if x["vs"] == "raw-nixl" else ">="
                tgt = f"  (target {rule} {x['target']})  {'PASS' if x['pass'] else 'MISS'}"
            paired = f" [{x['paired']:.3f}]" if x.get("paired") is not None else ""
            print(f"  {x['name']:<22} = {x['ratio']:.3f}{paired}{tgt}", file=out)


def run_writer(args: argparse.Namespace, plan: SyncPlan, peers: list[str] | None) -> int:
    from transport.cli.bench.put import Results

    t_start = time.perf_counter()
    probe = report.start_ucx_probe()
    torch.set_num_threads(1)
    res = Results()
    units = 2 + sum(b in plan.baselines for b in ("gloo", "nccl", "memcpy"))
    progress = report.Progress(units, report.progress_enabled(args.progress))
    progress.step("starting generators")
    try:
        with writer_session(args, "sync", peers, plan.generators, reader_args(plan)) as s:
            res.notes.extend(s.notes)
            w = SyncWriter(s.t, s.chan, s.readers, plan, res)
            try:
                w.setup(args.wait)
                progress.step(
                    f"ours{' + raw' if 'raw' in plan.baselines else ''}: {plan.steps} syncs"
                )
                watch = s.watch()
                w.measure()
                note_phase(res, "ours + raw", watch)
                unpin(s.saved_affinity)
                if "gloo" in plan.baselines:
                    progress.step("gloo broadcast")
                    watch = s.watch()
                    w.dist_phase("gloo", lambda rank: 0)
                    note_phase(res, "gloo", watch)
                if "nccl" in plan.baselines:
                    progress.step("nccl broadcast")
                    why = nccl_unavailable(w.ready, plan.generators + 1, s.local is not None)
                    if why:
                        res.skipped["nccl"] = why
                    else:
                        ndev = torch.cuda.device_count()
                        w.dist_phase("nccl", (lambda r: r % ndev) if s.local else (lambda r: 0))
                if "memcpy" in plan.baselines:
                    progress.step("memcpy")
                    w.memcpy_phase()
            finally:
                w.close()
    finally:
        progress.close()
    total = time.perf_counter() - t_start
    ucx = report.finish_ucx_probe(probe)
    env = report.environment(ucx)
    rs = ratios(res.records)
    out = sys.stdout
    print(
        f"transport bench sync: {env['cpu']['count']} CPUs ({env['cpu']['model']}); {report.ucx_summary(ucx)}",
        file=out,
    )
    print_table(plan, res.records, rs, out)
    res.notes.append(report.describe_code(env["code"]))
    print_notes(res, out)
    print(f"total {total:.1f} s", file=out)
    title = (f"transport bench sync: {human_bytes(plan.nbytes)} in "
             f"{plan.tensors} tensors to {plan.generators} generators ({plan.mode})")  # fmt: skip
    write_outputs(
        args,
        "sync",
        plan,
        res,
        rs,
        env,
        total,
        lambda path: report.plot_sync(res.records, path, title),
    )
    return 0 if all(r["verified"] for r in res.records) else 1
