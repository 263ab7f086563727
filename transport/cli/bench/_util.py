"""Small pieces every benchmark uses: sizes, statistics, timing loops, byte patterns, CPU use."""

from __future__ import annotations

import os
import re
import resource
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

SIZE_FORMS = (
    "a whole number with an optional suffix K, M or G (also KB/KiB, MB/MiB, GB/GiB; all powers "
    "of 1024), e.g. 4096, 4K, 64KiB, 1M, 1G"
)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_UNIT = {"": 1, "K": KiB, "M": MiB, "G": GiB}


def parse_size(text: str, what: str = "size") -> int:
    """``4K``, ``64KiB``, ``1M``, ``1G``, ``4096`` -> bytes (K/M/G are powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{what} {text!r} is not understood; use {SIZE_FORMS}")
    n = float(m.group(1)) * _UNIT[m.group(2).upper()]
    if n < 1 or n != int(n):
        raise ValueError(f"{what} {text!r} is not a whole number of at least 1")
    return int(n)


def parse_sizes(text: str, what: str = "size") -> list[int]:
    sizes = [parse_size(s, what) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"no {what} given; use a comma list of {SIZE_FORMS}")
    return sorted(set(sizes))


def parse_batch(text: str) -> tuple[int, int]:
    """``1000x64K`` -> (1000, 65536)."""
    count, sep, size = text.lower().partition("x")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"batch {text!r} is not COUNTxSIZE, e.g. 1000x64K (COUNT >= 1)")
    return int(count), parse_size(size, "batch tensor size")


def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def human_bytes(n: int) -> str:
    """``size_label`` where it is exact, else one decimal: ``1 GiB``, ``48.0 MiB``."""
    exact = size_label(n)
    if not exact.endswith(" B") or n < KiB:
        return exact
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return exact


def batch_label(count: int, size: int) -> str:
    return f"{count}x{size_label(size).replace(' ', '')}"


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(times_ns: Sequence[int], nbytes: int) -> dict[str, Any]:
    """Median, p10, p90, min (seconds) and GB/s (1e9 B/s, from the median) of per-iteration times."""
    ts = sorted(times_ns)
    med = statistics.median(ts) / 1e9
    return {
        "iters": len(ts),
        "median_s": med,
        "p10_s": ts[int(0.10 * (len(ts) - 1))] / 1e9,
        "p90_s": ts[int(0.90 * (len(ts) - 1))] / 1e9,
        "min_s": ts[0] / 1e9,
        "gbps": nbytes / med / 1e9 if med > 0 else float("inf"),
        "times_ns": list(times_ns),
    }


def time_loop(fn: Callable[[], object], budget_s: float, lo: int, hi: int, warm: int) -> list[int]:
    """Run ``fn`` ``warm`` times, then time it iteration by iteration: at least ``lo`` and at most
    ``hi`` iterations, stopping once ``budget_s`` seconds of timed iterations have passed."""
    for _ in range(warm):
        fn()
    clock = time.perf_counter_ns
    out: list[int] = []
    end = clock() + int(budget_s * 1e9)
    while len(out) < hi:
        t0 = clock()
        fn()
        t1 = clock()
        out.append(t1 - t0)
        if len(out) >= lo and t1 >= end:
            break
    return out


def interleave(
    fns: dict[str, Callable[[], object]],
    schedule: list[str],
    block: int,
    budget_s: float,
    lo: int,
    hi: int,
    warm: int,
) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Cycles of ``schedule``: each turn runs ``block`` iterations of one system, each timed on its
    own, so the machine's drift hits every system alike. ``warm`` untimed cycles first; then at
    least ``lo`` and at most ``hi`` cycles, stopping after ``budget_s`` seconds.

    Returns (times per system, per-cycle median per system): the second pairs the systems'
    iterations of the same cycle (milliseconds apart) for drift-free ratios."""
    for _ in range(warm):
        for name in schedule:
            f = fns[name]
            for _ in range(block):
                f()
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {name: [] for name in schedule}
    per_cycle: dict[str, list[float]] = {name: [] for name in schedule}
    end = clock() + int(budget_s * 1e9)
    cycles = 0
    while cycles < hi and (cycles < lo or clock() < end):
        cyc: dict[str, list[int]] = {name: [] for name in schedule}
        for name in schedule:
            f, out = fns[name], cyc[name]
            for _ in range(block):
                t0 = clock()
                f()
                out.append(clock() - t0)
        for name, ts in cyc.items():
            times[name].extend(ts)
            per_cycle[name].append(statistics.median(ts))
        cycles += 1
    return times, per_cycle


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over cycles of a/b within the same cycle."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


# -- byte patterns: a transfer that moved nothing (or the wrong bytes) never passes -----------------

_PERIOD = 251  # prime: a shifted, truncated or misplaced copy cannot match by accident
_BLOCK = 64 * KiB
_ext: torch.Tensor | None = None


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    global _ext
    if _ext is None:
        _ext = (torch.arange(_BLOCK + _PERIOD, dtype=torch.int32) % _PERIOD).to(torch.uint8)
    off = seed % _PERIOD
    return _ext[off : off + min(nbytes, _BLOCK)]


def _blocks(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(whole blocks view, tail view or None, the tensor as flat bytes)."""
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    whole = (n // _BLOCK) * _BLOCK if n >= _BLOCK else 0
    body = flat[:whole].view(-1, _BLOCK) if whole else flat[:0].view(0, 1)
    tail = flat[whole:] if whole < n else None
    return body, tail, flat


def fill_pattern(t: torch.Tensor, seed: int) -> None:
    """Fill a contiguous tensor (any dtype) with the byte pattern of ``seed``."""
    body, tail, _ = _blocks(t)
    if body.numel():
        body.copy_(_pattern(_BLOCK, seed).expand_as(body))
    if tail is not None:
        tail.copy_(_pattern(tail.numel(), seed))


def check_pattern(t: torch.Tensor, seed: int) -> bool:
    body, tail, _ = _blocks(t)
    ok = True
    if body.numel():
        ok = bool(torch.equal(body, _pattern(_BLOCK, seed).expand_as(body)))
    if ok and tail is not None:
        ok = bool(torch.equal(tail, _pattern(tail.numel(), seed)))
    return ok


def zero_bytes(t: torch.Tensor) -> None:
    t.reshape(-1).view(torch.uint8).zero_()


# -- CPUs -----------------------------------------------------------------------------------------


def pin_to(cpu_index: int | None, count: int = 1) -> int | None:
    """Pin the calling thread (and every thread it starts from now on) to ``count`` CPUs of this
    process's set from ``cpu_index`` on (modulo its size); returns the first CPU, or None when not
    pinned."""
    if cpu_index is None or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    chosen = {cpus[(cpu_index + i) % len(cpus)] for i in range(count)}
    os.sched_setaffinity(0, chosen)
    return cpus[cpu_index % len(cpus)]


def pin_layout(pin: bool | None, writer_cpus: int, readers: int) -> tuple[bool, str | None]:
    """Whether to pin the writer (to ``writer_cpus`` CPUs: one per lane, as its lanes copy in
    parallel) and each local reader (to one CPU each), and a note on why not. ``pin`` None: only
    when there are CPUs enough for all of them, since pinning lanes onto fewer CPUs than lanes
    would measure a writer that cannot use them."""
    ncpu = len(affinity() or {0})
    want = writer_cpus + readers
    if pin is None:
        if ncpu >= want:
            return True, None
        return False, (
            f"processes not pinned: the writer's {writer_cpus} lane(s) and {readers} reader(s) "
            f"need {want} CPUs, this host gives {ncpu} (--pin pins them anyway, sharing CPUs)"
        )
    return pin, None


def unpin(saved: set[int] | None) -> None:
    if saved and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, saved)


def affinity() -> set[int] | None:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


class CpuWatch:
    """How much CPU processes other than this one, its waited-for children and its helpers
    (``helpers()``: CPU seconds our readers on this host have used so far) used meanwhile."""

    def __init__(self, helpers: Callable[[], float] | None = None) -> None:
        self.helpers = helpers
        self.helpers0 = helpers() if helpers else 0.0
        self.start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter(), busy, me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def busy_cpus(self) -> float | None:
        """CPUs' worth of time others used since this watch began."""
        end = self._snapshot()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        helpers = (self.helpers() - self.helpers0) if self.helpers else 0.0
        other = (end[1] - self.start[1]) - (end[2] - self.start[2]) - helpers
        return max(0.0, other) / (end[0] - self.start[0])
