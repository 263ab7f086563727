"""The one runner of both bench commands: phases of configurations, each configuration's systems
interleaved or timed alone, every system verified; CPU pinning and accounting, progress, the
report, JSON and the plot. What is measured comes from a :class:`Workload`."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import torch

from transport import CliError, Transport
from transport.cli.bench import _report
from transport.cli.bench._session import Session, writer_session
from transport.cli.bench._systems import Group, System
from transport.cli.bench._util import Stats, check_all, unpin


@dataclass
class Record:
    """One system's result in one configuration: the timing, whether its bytes were verified, the
    system's ``extra`` fields and its paired time ratios. ``case``: the configuration's
    coordinates (a frozen dataclass whose fields, ending with ``bytes``, go into the JSON; its
    bytes go to ``case.copies()`` peers)."""

    system: str
    family: str
    case: Any
    stats: Stats
    verified: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    paired_time_ratio: dict[str, float] = field(default_factory=dict)

    def json(self) -> dict[str, Any]:
        total = self.case.bytes * self.case.copies()
        paired = {"paired_time_ratio": self.paired_time_ratio} if self.paired_time_ratio else {}
        return {
            "system": self.system,
            "family": self.family,
            **asdict(self.case),  # type: ignore[call-overload]
            "total_bytes": total,
            **asdict(self.stats),
            "verified": self.verified,
            **self.extra,
            **paired,
        }


@dataclass(frozen=True)
class Ratio:
    """Ours against another system (or the reverse, as ``name`` says), with the paired ratio
    within cycles where both ran interleaved, and the target it is held to (``passed``)."""

    vs: str
    ratio: float
    paired: float | None = None
    target: float | None = None
    passed: bool | None = None
    name: str | None = None
    case: Any = None  # the workload's Case
    metric: str | None = None

    def json(self) -> dict[str, Any]:
        head = {"name": self.name} if self.name else {}
        head.update(asdict(self.case) if self.case else {})  # type: ignore[call-overload]
        head.update({"metric": self.metric} if self.metric else {})
        return {
            **head,
            "vs": self.vs,
            "ratio": self.ratio,
            "paired": self.paired,
            "target": self.target,
            "pass": self.passed,
        }


@dataclass
class Results:
    """What a run collects for its report and JSON: records, notes, the skipped baselines (with
    why) and per phase the CPU that other processes used."""

    records: list[Record] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    phases: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Timing:
    """Interleaved: ``warm`` untimed cycles, then ``lo`` to ``hi`` cycles until ``budget_s`` has
    passed, a cycle giving each system ``block`` transfers. Alone: ``warm`` transfers estimate
    one's time, then ``budget_s`` worth of transfers (``lo`` to ``hi``)."""

    budget_s: float
    lo: int
    hi: int
    warm: int = 1
    block: int = 1


@dataclass
class Turn:
    """One configuration's systems, run alone or, with a ``schedule`` (names, repeats allowed),
    interleaved cycle by cycle so that drift hits them alike; ``pairs`` (a, b) give a's paired
    ratio to b (median over cycles). The runner closes every system after the turn."""

    label: str
    case: Any  # as in Record
    systems: list[System]
    timing: Timing
    schedule: list[str] | None = None
    pairs: list[tuple[str, str]] = field(default_factory=list)
    cycles: bool = True


class Workload(ABC):
    """What one bench command measures (a dataclass: its fields are the JSON's ``config``), made
    alike from the command line in the writer and in every reader. The writer: :meth:`setup` in
    a session, then the turns of :meth:`main_turns`, :meth:`dist_turns` (gloo, NCCL) and
    :meth:`memcpy_turns` (:meth:`units` in all), :meth:`close` in any case, then :meth:`ratios`,
    :meth:`report` and :meth:`plot`. A reader: :meth:`prepare_reader`, :meth:`open_reader`, then at the writer's "setup"
    :meth:`expose`; commands name tensors by a ``spec`` (:meth:`select`); then :meth:`close`."""

    command: str = ""
    main_phase: str = ""
    memcpy_watch: bool = True
    readers: int
    ks: list[int]  # receiver counts, for the collectives' groups
    baselines: list[str]

    def reader_args(self) -> list[str]:
        """The flags local readers need to build the same workload."""
        return []

    def prepare_reader(self) -> None:  # noqa: B027 - a hook
        """The reader's data, made before it joins (what a user holds before it syncs: not
        part of any setup the writer measures)."""

    def open_reader(self, t: Transport) -> None:  # noqa: B027 - a hook
        """The reader's side, as soon as it has joined."""

    @abstractmethod
    def expose(self, t: Transport, m: dict[str, Any]) -> tuple[list[torch.Tensor], dict]:
        """The reader's tensors (exposed; raw NIXL registers them) and their addresses for the
        writer (``m``: the writer's "setup")."""

    def select(self, spec: dict[str, Any], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of a reader's tensors ``xs`` (or of their copies) that ``spec`` names."""
        return xs

    def check(self, spec: dict[str, Any], seed: int, xs: list[torch.Tensor]) -> dict[str, Any]:
        """The reader's reply to "check": whether ``xs`` hold the pattern of ``seed``."""
        return {"ok": check_all(xs, seed)}

    @abstractmethod
    def setup(self, s: Session, res: Results) -> None: ...
    @abstractmethod
    def units(self) -> int: ...
    def close(self) -> None: ...  # noqa: B027 - what setup or open_reader took, also after a failure
    @abstractmethod
    def main_turns(self) -> Iterator[Turn]: ...
    @abstractmethod
    def dist_turns(self, group: Group, backend: str) -> Iterator[Turn]: ...
    @abstractmethod
    def memcpy_turns(self) -> Iterator[Turn]: ...

    @abstractmethod
    def ratios(self, records: list[Record]) -> list[Ratio]: ...
    @abstractmethod
    def report(
        self, res: Results, ratios: list[Ratio], env: dict[str, Any], out: IO[str]
    ) -> None: ...
    @abstractmethod
    def plot(self, records: list[Record], path: str, env: dict[str, Any]) -> None: ...


def interleave(t: Turn) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Times per system and per-cycle medians per system, of cycles of ``t.schedule``."""
    systems = {s.name: s for s in t.systems}
    sched, tm = [systems[n] for n in t.schedule or []], t.timing
    for _ in range(tm.warm):
        for s in sched:
            s.run(tm.block)
    times: dict[str, list[int]] = {s.name: [] for s in sched}
    per_cycle: dict[str, list[float]] = {s.name: [] for s in sched}
    clock = time.perf_counter_ns
    end, cycles = clock() + int(tm.budget_s * 1e9), 0
    while cycles < tm.hi and (cycles < tm.lo or clock() < end):
        cyc: dict[str, list[int]] = {s.name: [] for s in sched}
        for s in sched:
            cyc[s.name] += s.run(tm.block)
        for name, ts in cyc.items():
            times[name] += ts
            per_cycle[name].append(statistics.median(ts))
        cycles += 1
    return times, per_cycle


def measure(t: Turn, res: Results, seeds: Iterator[int]) -> None:
    """Time, verify and record one turn's systems; CliError when a system's bytes did not land."""
    try:
        for s in t.systems:
            s.setup()
        if t.schedule:
            times, per_cycle = interleave(t)
        else:
            tm, times, per_cycle = t.timing, {}, {}
            for s in t.systems:  # alone: the first transfers estimate how many fit the budget
                per = max(statistics.median(s.run(tm.warm)), 1) / 1e9
                times[s.name] = s.run(int(min(tm.hi, max(tm.lo, tm.budget_s / per))))
        recs: dict[str, Record] = {}
        for s in t.systems:
            stats = Stats.of(times[s.name], t.case.bytes * t.case.copies())
            rec = recs[s.name] = Record(s.name, s.family, t.case, stats)
            if t.cycles and t.schedule:
                rec.extra.update(block=t.timing.block, cycles=len(per_cycle[s.name]))
            rec.verified = s.verify(next(seeds))
            if not rec.verified:
                raise CliError(f"{s.name}, {t.label}: the bytes did not land")
            rec.extra.update(s.extra())
        for a, b in t.pairs:
            pairs = zip(per_cycle[a], per_cycle[b], strict=True)
            recs[a].paired_time_ratio[b] = statistics.median(x / y for x, y in pairs)
        res.records += recs.values()
    finally:
        for s in t.systems:
            s.close()


def run_phases(w: Workload, s: Session, res: Results, step: Callable[[str], None]) -> None:
    """Ours (with raw NIXL) while pinned, then the baselines asked for, unpinned: gloo and NCCL
    (each in a process group), memcpy; with the CPU other processes used during each phase."""

    def dist(backend: str) -> Iterator[Turn]:
        group = Group.open(s, backend, w.ks)
        try:
            yield from w.dist_turns(group, backend)
        finally:
            group.close(s)

    seeds = itertools.count(1007, 7)
    for i, (name, turns, watch, skip) in enumerate(
        [
            (w.main_phase, w.main_turns, True, None),
            ("gloo", lambda: dist("gloo"), True, None),
            ("nccl", lambda: dist("nccl"), False, s.nccl_unavailable()),
            ("memcpy", w.memcpy_turns, w.memcpy_watch, None),
        ]
    ):
        if i and name not in w.baselines:
            continue
        if skip:
            res.skipped[name] = skip
            continue
        if i:
            unpin(s.saved_affinity)
        busy_cpus = s.watch()
        for turn in turns():
            step(turn.label)
            measure(turn, res, seeds)
        if watch and (other := busy_cpus()) is not None:
            res.phases.append({"phase": name, "other_cpus": other})
            if other > 0.15:
                res.notes.append(
                    f"BUSY MACHINE: other processes used {100 * other:.0f}% of a CPU "
                    f"during {name}; on a small machine that moves the ratios, rerun "
                    "when it is quiet"
                )


def run_writer(args: argparse.Namespace, w: Workload, peers: list[str] | None) -> int:
    """A bench command as the writer: local readers, or the named peers of a store. Exit status
    1 when a record is not verified."""
    t_start = time.perf_counter()
    ucx = _report.ucx_probe()
    # memcpy with one thread, like CMA; and no torch pool threads pinned along with the main thread
    torch.set_num_threads(1)
    res = Results()
    with _report.progress(args.progress) as bar:
        task = bar.add_task("starting readers", total=w.units() + 1)
        step = lambda label: bar.update(task, advance=1, description=label)  # noqa: E731
        with writer_session(args, [w.command, *w.reader_args()], w.readers, peers) as s:
            res.notes += s.notes
            try:
                w.setup(s, res)
                run_phases(w, s, res, step)
            finally:
                w.close()
    total = time.perf_counter() - t_start
    env = _report.environment(ucx())
    ratios, out = w.ratios(res.records), sys.stdout
    w.report(res, ratios, env, out)
    res.notes.append(_report.describe_code(env["code"]))
    lines = [f"  {k}: {v}" for k, v in res.skipped.items()]
    _report.text(out, *(["\nskipped:", *lines] if lines else []))
    _report.text(out, *(["\nnotes:", *(f"  {n}" for n in res.notes)] if res.notes else []))
    _report.text(out, f"total {total:.1f} s")
    if args.json:
        doc = {
            "command": ["transport", *sys.argv[1:]],
            "config": asdict(w),  # type: ignore[call-overload]
            "environment": env,
            "records": [r.json() for r in res.records],
            "ratios": [x.json() for x in ratios],
            "skipped": res.skipped,
            "notes": res.notes,
            "phases": res.phases,
            "total_s": total,
        }
        with open(args.json + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    if args.plot:
        w.plot(res.records, args.plot, env)
    return 0 if all(r.verified for r in res.records) else 1
