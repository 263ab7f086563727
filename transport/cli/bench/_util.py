"""Small pieces every benchmark uses: sizes and labels, statistics, byte patterns, CPUs and
threads."""

from __future__ import annotations

import os
import re
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))
SIZE_FORMS = (
    "a whole number with an optional suffix K, M or G (also KB/KiB, MB/MiB, GB/GiB; all powers "
    "of 1024), e.g. 4096, 4K, 64KiB, 1M, 1G"
)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str, what: str = "size") -> int:
    """``4K``, ``64KiB``, ``1M``, ``1G``, ``4096`` -> bytes (K/M/G are powers of 1024)."""
    if (m := _SIZE.fullmatch(text.strip())) is None:
        raise ValueError(f"{what} {text!r} is not understood; use {SIZE_FORMS}")
    n = float(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()]
    if n < 1 or n != int(n):
        raise ValueError(f"{what} {text!r} is not a whole number of at least 1")
    return int(n)


def parse_sizes(text: str, what: str = "size") -> list[int]:
    """A comma list of sizes, sorted, without repeats."""
    if not (sizes := [parse_size(s, what) for s in text.split(",") if s.strip()]):
        raise ValueError(f"no {what} given; use a comma list of {SIZE_FORMS}")
    return sorted(set(sizes))


def parse_batch(text: str) -> tuple[int, int]:
    """``1000x64K`` -> (1000, 65536)."""
    count, sep, size = text.lower().partition("x")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"batch {text!r} is not COUNTxSIZE, e.g. 1000x64K (COUNT >= 1)")
    return int(count), parse_size(size, "batch tensor size")


def size_label(n: int) -> str:
    """``4 KiB``, ``1 GiB``; bytes where no unit divides ``n``."""
    return next((f"{n // u} {name}" for u, name in _UNITS if n >= u and n % u == 0), f"{n} B")


def human_bytes(n: int) -> str:
    """``size_label`` where it is exact, else one decimal: ``1 GiB``, ``48.0 MiB``."""
    if not (exact := size_label(n)).endswith(" B") or n < KiB:
        return exact
    return next(f"{n / u:.1f} {name}" for u, name in _UNITS if n >= u)


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.2f} ms" if s < 1.0 else f"{s:.3f} s"


@dataclass(frozen=True)
class Stats:
    """Per-iteration wall times of one system in one configuration and what a report reads from
    them: median, p10, p90, min (seconds) and GB/s (1e9 B/s of ``nbytes``, at the median)."""

    iters: int
    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    gbps: float
    times_ns: list[int] = field(repr=False)

    @classmethod
    def of(cls, times_ns: Sequence[int], nbytes: int) -> Stats:
        ts = sorted(times_ns)
        med = statistics.median(ts) / 1e9
        at = lambda q: ts[int(q * (len(ts) - 1))] / 1e9  # noqa: E731
        gbps = nbytes / med / 1e9 if med > 0 else float("inf")
        return cls(len(ts), med, at(0.10), at(0.90), ts[0] / 1e9, gbps, list(times_ns))


# -- byte patterns: a transfer that moved nothing (or the wrong bytes) never passes -----------------

_PERIOD = 251  # prime: a shifted, truncated or misplaced copy cannot match by accident
_BLOCK = 64 * KiB
_EXT = (torch.arange(_BLOCK + _PERIOD, dtype=torch.int32) % _PERIOD).to(torch.uint8)


def _parts(t: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The bytes of ``t`` as rows of whole pattern blocks and the tail, each with its pattern."""
    flat = as_bytes(t)
    whole, off = flat.numel() // _BLOCK * _BLOCK, seed % _PERIOD
    parts = [flat[:whole].view(-1, _BLOCK)] if whole else []
    parts += [flat[whole:]] if whole < flat.numel() else []
    return [(p, _EXT[off : off + min(p.shape[-1], _BLOCK)].expand_as(p)) for p in parts]


def fill_all(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Fill contiguous tensors (any dtype) with the byte patterns of ``seed``, ``seed + 1``, .."""
    for j, x in enumerate(tensors):
        for part, pattern in _parts(x, seed + j):
            part.copy_(pattern)


def check_all(tensors: Sequence[torch.Tensor], seed: int) -> bool:
    """Whether every byte is the one :func:`fill_all` wrote."""
    return all(torch.equal(p, q) for j, x in enumerate(tensors) for p, q in _parts(x, seed + j))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view: patterns and collectives move bytes whatever the dtype."""
    return t.reshape(-1).view(torch.uint8)


def zero_all(tensors: Sequence[torch.Tensor]) -> None:
    for x in tensors:
        x.zero_()


def zero_storages(tensors: Sequence[torch.Tensor]) -> None:
    """Zero every byte of the memory under ``tensors``: the whole of each storage (a buffer the
    caller owns, such as a flat layout's), once however many views of it there are."""
    whole: dict[tuple[int, str], torch.Tensor] = {}
    for x in tensors:
        storage = x.untyped_storage()
        key = (storage.data_ptr(), str(x.device))
        if key not in whole:
            whole[key] = torch.empty(0, dtype=torch.uint8, device=x.device).set_(storage)
    for buffer in whole.values():
        buffer.zero_()


# -- CPUs -----------------------------------------------------------------------------------------


def affinity() -> set[int] | None:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def pin_to(cpu_index: int | None, count: int = 1) -> None:
    """Pin the calling thread (and every thread it starts from now on) to ``count`` CPUs of this
    process's set from ``cpu_index`` on (modulo its size)."""
    if cpu_index is not None and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[(cpu_index + i) % len(cpus)] for i in range(count)})


def unpin(saved: set[int] | None) -> None:
    if saved and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, saved)


def pin_layout(pin: bool | None, writer_cpus: int, readers: int) -> tuple[bool, str | None]:
    """Whether to pin the writer (a CPU per lane) and local readers (one each), and why not: by
    default only with CPUs enough, as lanes sharing a CPU could not copy in parallel."""
    ncpu, want = len(affinity() or {0}), writer_cpus + readers
    if pin is not None or ncpu >= want:
        return pin is not False, None
    return False, (
        f"processes not pinned: the writer's {writer_cpus} lane(s) and {readers} reader(s) "
        f"need {want} CPUs, this host gives {ncpu} (--pin pins them anyway, sharing CPUs)"
    )


def process_cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has used so far (user and system, from /proc; 0 where it cannot
    be read: the process is gone, or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def thread_wakeups() -> dict[str, int]:
    """The voluntary context switches of each thread of this process so far (the times it slept
    and was woken), by its Python name; threads of none (NIXL's, UCX's) are ``native-<id>``.
    Load adds involuntary switches only, so a count of these over a window is an upper bound
    that a loaded host does not break. Empty where /proc is unreadable."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next(x for x in f if x.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue  # the thread ended meanwhile
        out[names.get(int(tid), f"native-{tid}")] = int(line.split()[1])
    return out


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(now, busy CPU seconds of the host, CPU seconds of this process and its waited children)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    usage = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    mine = sum(r.ru_utime + r.ru_stime for r in usage)
    return time.perf_counter(), (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK"), mine


def cpu_watch(helpers: Callable[[], float]) -> Callable[[], float | None]:
    """A function giving the CPUs others used since now: not this process, its children nor its
    helpers (``helpers()``: our readers' CPU seconds so far); None where /proc is unreadable."""
    h0, start = helpers(), _cpu_snapshot()

    def busy_cpus() -> float | None:
        end = _cpu_snapshot()
        if start is None or end is None or end[0] <= start[0]:
            return None
        other = (end[1] - start[1]) - (end[2] - start[2]) - (helpers() - h0)
        return max(0.0, other) / (end[0] - start[0])

    return busy_cpus


def group_pids(pgid: int) -> list[int]:
    """Every process of a process group (a server and its workers)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append(int(d))
        except (OSError, IndexError):
            continue  # it ended meanwhile
    return out


class CpuMeter:
    """CPU time the rest of the machine used (everything but this process and a server's
    process group) over an interval: the share of its cores that the measured systems could not
    have. It owns the pids it leaves out, read once at construction."""

    def __init__(self, pgid: int) -> None:
        self.pids = [os.getpid(), *group_pids(pgid)]

    def ticks(self) -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = sum(v[:3]) + sum(v[5:8])  # user nice system, irq softirq steal
        ours = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])  # utime, stime (all its threads)
            except (OSError, IndexError):
                continue
        return busy, ours

    def foreign(self, t0: tuple[int, int], t1: tuple[int, int], seconds: float) -> float:
        """The other processes' CPU over the interval, in cores (0: none; 1: one core busy)."""
        other = (t1[0] - t0[0]) - (t1[1] - t0[1])
        return max(0.0, other / os.sysconf("SC_CLK_TCK") / seconds)
