"""What a bench run prints and writes: the table, the ratios, JSON with the environment, a plot,
and the progress bar."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

from transport.cli import CliError
from transport.cli.bench._util import KiB, MiB, fmt_time, size_label

SYSTEM_ORDER = [
    "memcpy", "gloo", "gloo-bcast", "nccl-bcast", "raw-nixl", "raw-nixl-repost", "ours", "ours-single",
]  # fmt: skip
LATENCY_MAX = 64 * KiB  # at and below: compare latency; above: bandwidth
TARGETS = {"latency": 1.3, "bandwidth": 0.95}  # ours against raw-nixl, one receiver
COLORS = {
    "ours": "tab:red", "ours-single": "tab:pink", "raw-nixl": "tab:blue", "raw-nixl-repost": "tab:cyan",
    "gloo": "tab:green", "gloo-bcast": "tab:olive", "nccl-bcast": "tab:purple", "memcpy": "tab:gray",
    "ours-chain": "tab:orange", "ours-tree": "tab:brown",
}  # fmt: skip


# -- progress -----------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (only when enabled): ``step(label)`` starts the next unit."""

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None = None) -> None:
        self.total, self.enabled = max(1, total), enabled
        self.stream = stream or sys.stderr
        self.done = -1
        self.start = time.monotonic()
        self.width = 0

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(24 * frac)
        line = (
            f"[{bar:<24}] {self.done}/{self.total} {time.monotonic() - self.start:5.0f} s  {label}"[
                :110
            ]
        )
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def close(self) -> None:
        if self.enabled and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def progress_enabled(flag: bool | None) -> bool:
    return flag if flag is not None else sys.stderr.isatty()


# -- environment --------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_info() -> dict[str, Any]:
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model or platform.processor() or None,
        "count": os.cpu_count(),
        "usable": usable,
    }


def gpu_info() -> list[dict[str, Any]] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return [
        {"index": i, "name": torch.cuda.get_device_name(i),
         "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]  # fmt: skip


def start_ucx_probe() -> subprocess.Popen[str] | None:
    """What UCX picks for a put and a get between two agents on this host: a child process with
    UCX_PROTO_INFO=y (read back by :func:`finish_ucx_probe`)."""
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "transport.cli.bench._ucxprobe"], env=env, text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
    except OSError:
        return None


_PREFIX = re.compile(r"^\[[^]]*\]\s*\[[^]]*\]\s*")


def parse_ucx_info(text: str) -> dict[str, Any]:
    """The UCX version, the lanes of an intra-node endpoint and the protocol tables for remote
    memory writes and reads, from UCX_PROTO_INFO=y output."""
    out: dict[str, Any] = {}
    title: list[str] = []
    last = ""
    tables: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        m = re.search(r"UCX\s+INFO\s+Version (\S+)", line)
        if m:
            out["version"] = m.group(1)
        m = re.search(r"UCX\s+INFO\s+\S+ intra-node cfg#\d+ (.*)$", line)
        if m:
            out["lanes"] = " ".join(m.group(1).split())
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:
            if last != "title":
                title = []
            title.append(cells[0])
            last = "title"
            continue
        last = "row"
        if len(cells) != 3 or cells[0] == "Range" or len(title) < 2:
            continue
        if "intra-node" in title[0] and title[1].startswith("remote memory"):
            row = " ".join(cells)
            rows = tables.setdefault(title[1], [])
            if row not in rows:
                rows.append(row)
    out["protocols"] = tables
    return out


def finish_ucx_probe(proc: subprocess.Popen[str] | None) -> dict[str, Any]:
    info: dict[str, Any] = {"UCX_TLS": os.environ.get("UCX_TLS", "default")}
    info.update({k: v for k, v in os.environ.items() if k.startswith("UCX_") and k != "UCX_TLS"})
    if proc is None:
        return info
    try:
        text, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        info["probe"] = "timed out"
        return info
    info["probe"] = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    info.update(parse_ucx_info(text))
    return info


def ucx_summary(ucx: dict[str, Any]) -> str:
    """``UCX 1.23.0, UCX_TLS=default (put: 0..inf zero-copy cma/memory; get: ...)``."""
    chosen = []
    tables = ucx.get("protocols", {})
    for what, key in (("put", "remote memory write"), ("get", "remote memory read")):
        names = sorted((n for n in tables if n.startswith(key)), key=lambda n: "*(" in n)
        if names:
            chosen.append(f"{what}: " + ", ".join(tables[names[0]]))
    return f"UCX {ucx.get('version', '?')}, UCX_TLS={ucx['UCX_TLS']}" + (
        f" ({'; '.join(chosen)})" if chosen else ""
    )


def code_info() -> dict[str, Any]:
    """Which ``transport`` was measured: its directories and, in a git checkout, the commit and
    the files with uncommitted changes (others may be editing the tree being measured)."""
    import transport
    import transport.backends

    where = os.path.dirname(os.path.abspath(transport.__file__))
    info: dict[str, Any] = {
        "transport": where,
        "backends": os.path.dirname(os.path.abspath(transport.backends.__file__)),
    }
    root = os.path.dirname(where)

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", "-C", root, *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    sha = git("rev-parse", "--short", "HEAD")
    if sha:
        info["commit"] = sha.strip()
        dirty = git("status", "--porcelain", "--", "transport", "backends") or ""
        info["uncommitted"] = [ln[3:] for ln in dirty.splitlines() if ln.strip()]
    return info


def describe_code(info: dict[str, Any]) -> str:
    if "commit" not in info:
        return f"transport from {info['transport']}"
    dirty = info.get("uncommitted") or []
    state = f"UNCOMMITTED changes in {', '.join(dirty)}" if dirty else "clean"
    return f"transport from {info['transport']} (git {info['commit']}, {state})"


def environment(ucx: dict[str, Any]) -> dict[str, Any]:
    import torch

    import transport

    return {
        "versions": {
            "transport": getattr(transport, "__version__", None) or _version("transport"),
            "torch": torch.__version__,
            "nixl": {d: v for d in ("nixl-cu13", "nixl-cu12", "nixl") if (v := _version(d))},
            "numpy": _version("numpy"),
            "msgpack": _version("msgpack"),
            "python": platform.python_version(),
        },
        "ucx": ucx,
        "cpu": cpu_info(),
        "gpu": gpu_info(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "code": code_info(),
    }


# -- ratios, tables -----------------------------------------------------------------------------


def find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def put_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against every other system measured in the same configuration. ``ratio``: ours/other
    time (latency, <= 1 is better) or other/ours time = ours/other bandwidth (>= 1 is better)."""
    out = []
    for r in records:
        if r["system"] != "ours":
            continue
        metric = "latency" if r["bytes"] <= LATENCY_MAX and r["kind"] == "single" else "bandwidth"
        for o in records:
            same = all(o[k] == r[k] for k in ("receivers", "kind", "size"))
            if not same or o["system"] in ("ours", "ours-single"):
                continue
            if o["family"] in ("raw",) and o["op"] != r["op"]:
                continue
            if o["family"] not in ("raw",) and r["op"] != "write":
                continue  # gloo, NCCL and memcpy have no READ
            ratio = (
                r["median_s"] / o["median_s"]
                if metric == "latency"
                else o["median_s"] / r["median_s"]
            )
            paired = r.get("paired_time_ratio", {}).get(o["system"])
            if paired is not None and metric == "bandwidth":
                paired = 1.0 / paired
            target = (
                TARGETS[metric]
                if o["system"] == "raw-nixl" and r["receivers"] == 1 and r["kind"] == "single"
                else None
            )
            if target is not None and metric == "bandwidth" and r["bytes"] < 64 * MiB:
                target = None
            ok = None
            if target is not None:
                ok = ratio <= target if metric == "latency" else ratio >= target
            out.append({
                "op": r["op"], "receivers": r["receivers"], "kind": r["kind"], "size": r["size"],
                "bytes": r["bytes"], "metric": metric, "vs": o["system"], "ratio": ratio,
                "paired": paired, "target": target, "pass": ok,
            })  # fmt: skip
    return out


def _sorted_sizes(records: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], int] = {}
    for r in records:
        seen.setdefault((r["kind"], r["size"]), r["bytes"] + (1 if r["kind"] == "batch" else 0))
    return sorted(seen, key=lambda k: seen[k])


def _rel(r: dict[str, Any], o: dict[str, Any] | None, latency: bool) -> str:
    """``r`` against ``o``: time ratio (latency) or bandwidth ratio."""
    if o is None or o is r:
        return "-"
    x = r["median_s"] / o["median_s"] if latency else o["median_s"] / r["median_s"]
    return f"{x:.2f}x {'time' if latency else 'bw'}"


def put_table(records: list[dict[str, Any]], ratios: list[dict[str, Any]], out: IO[str]) -> None:
    blocks: list[tuple[str, int]] = []
    for r in records:
        key = (r["op"], r["receivers"])
        if key not in blocks and r["family"] in ("ours", "raw"):
            blocks.append(key)
    for r in records:  # baselines without ours (e.g. only gloo at k)
        if (r["op"], r["receivers"]) not in blocks:
            blocks.append((r["op"], r["receivers"]))
    hdr = f"{'size':>11}  {'system':<16} {'median':>10} {'GB/s':>8} {'vs raw-nixl':>13} {'vs ours':>10} {'p10..p90':>21} {'iters':>6}  ok"
    for op, k in blocks:
        rows = [r for r in records if r["op"] == op and r["receivers"] == k]
        print(f"\n{op.upper()}, {k} receiver{'s' if k > 1 else ''}"
              + (" (GB/s: bytes delivered to all receivers)" if k > 1 else ""), file=out)  # fmt: skip
        print(hdr, file=out)
        print("-" * len(hdr), file=out)
        for kind, size in _sorted_sizes(rows):
            sel = sorted(
                (r for r in rows if r["kind"] == kind and r["size"] == size),
                key=lambda r: (
                    SYSTEM_ORDER.index(r["system"]) if r["system"] in SYSTEM_ORDER else 99
                ),
            )
            ref = find(sel, system="raw-nixl")
            ours = find(sel, system="ours")
            lat = kind == "single" and sel[0]["bytes"] <= LATENCY_MAX
            for r in sel:
                spread = f"{fmt_time(r['p10_s'])}..{fmt_time(r['p90_s'])}"
                print(f"{size:>11}  {r['system']:<16} {fmt_time(r['median_s']):>10} {r['gbps']:8.3f} "
                      f"{_rel(r, ref, lat):>13} {_rel(r, ours, lat):>10} {spread:>21} {r['iters']:>6}  "
                      f"{'yes' if r['verified'] else 'NO'}", file=out)  # fmt: skip
            print("-" * len(hdr), file=out)
    targets = [x for x in ratios if x["target"] is not None]
    if targets:
        print("\ntargets: ours against raw-nixl (make + post + poll + release per transfer), one receiver;"
              " ratio of medians [paired within cycles]", file=out)  # fmt: skip
        for x in targets:
            rule = ("<=" if x["metric"] == "latency" else ">=") + f" {x['target']}"
            paired = f" [{x['paired']:.3f}]" if x["paired"] is not None else ""
            print(f"  {x['op'].upper():<5} {x['size']:>8} {x['metric']:<9} ours/raw = {x['ratio']:.3f}{paired}"
                  f"  (target {rule})  {'PASS' if x['pass'] else 'MISS'}", file=out)  # fmt: skip
    others = [
        x
        for x in ratios
        if x["vs"] in ("gloo", "gloo-bcast", "nccl-bcast") and x["kind"] == "single"
    ]
    if others:
        print(
            "\nours against torch.distributed (send/recv or broadcast, each with a 1-byte ack):",
            file=out,
        )
        for x in others:
            if x["metric"] == "latency":
                what = f"{x['vs']}/ours latency = {1 / x['ratio']:.1f}x"
            else:
                what = f"ours/{x['vs']} bandwidth = {x['ratio']:.2f}x"
            print(f"  {x['op'].upper():<5} {x['receivers']} recv {x['size']:>8}  {what}", file=out)


def check_plot_support() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install transport[bench]") from None


def plot_put(records: list[dict[str, Any]], path: str, title: str) -> None:
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, lat) = plt.subplots(1, 2, figsize=(13, 5.2))
    lines: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == "single" and r["system"] != "ours-single":
            lines.setdefault((r["system"], r["op"], r["receivers"]), []).append(r)

    def order(key: tuple[str, str, int]) -> tuple[int, int, int]:
        system, op, k = key
        rank = SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else 99
        return (op != "write", k, rank)

    sizes: set[int] = set()
    for key in sorted(lines, key=order):
        system, op, k = key
        rs = sorted(lines[key], key=lambda r: r["bytes"])
        label = system + ("" if op == "write" else f" ({op})") + ("" if k == 1 else f" x{k}")
        style = dict(
            color=COLORS.get(system), linestyle="-" if op == "write" else "--", marker="o",
            linewidth=2.2 if system == "ours" else 1.4, label=label, alpha=1.0 if k == 1 else 0.6,
        )  # fmt: skip
        xs = [r["bytes"] for r in rs]
        sizes.update(xs)
        bw.plot(xs, [r["gbps"] for r in rs], **style)  # type: ignore[arg-type]
        lat.plot(xs, [r["median_s"] * 1e6 for r in rs], **style)  # type: ignore[arg-type]
    ticks = sorted(sizes)
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [size_label(n).replace(" ", "") for n in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("transfer size (per receiver)")
        ax.grid(True, which="major", alpha=0.3)
    bw.set_ylabel("GB/s (median)")
    lat.set_ylabel("time per transfer (us, median)")
    lat.set_yscale("log")
    bw.set_title("bandwidth")
    lat.set_title("latency")
    bw.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sync(records: list[dict[str, Any]], path: str, title: str) -> None:
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r["system"] for r in records]
    ax.bar(
        names, [r["median_s"] for r in records], color=[COLORS.get(n, "tab:blue") for n in names]
    )
    for i, r in enumerate(records):
        ax.text(
            i,
            r["median_s"],
            f"{fmt_time(r['median_s'])}\n{r['gbps']:.2f} GB/s",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, 1.2 * max((r["median_s"] for r in records), default=1.0))
    ax.set_ylabel("time per weight sync (s, median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
