"""How a run shows itself and where it ran: progress on stderr and tables on stdout (rich), the
plot (matplotlib, optional), and the environment (versions, CPU, GPU, which ``transport``, what
UCX picks here: a probe process with UCX_PROTO_INFO=y, its findings kept for later runs)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from transport import CliError
from transport.cli.bench._util import fmt_time

SYSTEM_ORDER = [
    "memcpy",
    "gloo",
    "gloo-bcast",
    "nccl-bcast",
    "raw-nixl",
    "raw-nixl-repost",
    "ours",
    "ours-single",
    "ours-chain",
    "ours-tree",
]
COLORS = {
    "ours": "tab:red",
    "ours-single": "tab:pink",
    "raw-nixl": "tab:blue",
    "raw-nixl-repost": "tab:cyan",
    "gloo": "tab:green",
    "gloo-bcast": "tab:olive",
    "nccl-bcast": "tab:purple",
    "memcpy": "tab:gray",
    "ours-chain": "tab:orange",
    "ours-tree": "tab:brown",
}


def rank(system: str) -> int:
    """A system's place in tables and legends (unknown ones last)."""
    return SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else 99


def progress(enabled: bool | None) -> Progress:
    """A progress bar on stderr, shown only when ``enabled`` (None: when stderr is a terminal);
    removed from the screen when the run ends."""
    on = sys.stderr.isatty() if enabled is None else enabled
    console = Console(file=sys.stderr, force_terminal=on or None)
    columns = (
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    return Progress(*columns, console=console, transient=True, disable=not on)


def text(out: IO[str], *lines: str) -> None:
    """Plain lines, as they are (no markup)."""
    for line in lines:
        print(line, file=out)


def table(out: IO[str], columns: str, sections: Sequence[Sequence[Sequence[str]]]) -> None:
    """A table of ``columns`` (a '|' between them; a leading '<' aligns one left), rows in
    ``sections`` apart."""
    t = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False)
    for c in columns.split("|"):
        t.add_column(c.lstrip("<"), justify="left" if c.startswith("<") else "right")
    for rows in sections:
        for i, row in enumerate(rows):
            t.add_row(*map(Text, row), end_section=i == len(rows) - 1)
    Console(file=out, width=200, highlight=False, markup=False, emoji=False).print(t)


def cells(r: Any, *rels: str) -> list[str]:
    """A record's table cells: median, GB/s, the ``rels`` (its ratios), p10..p90, count, ok."""
    st = r.stats
    spread = f"{fmt_time(st.p10_s)}..{fmt_time(st.p90_s)}"
    ok = "yes" if r.verified else "NO"
    return [fmt_time(st.median_s), f"{st.gbps:.3f}", *rels, spread, str(st.iters), ok]


def check_plot_support() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("--plot needs matplotlib: pip install transport[bench]") from None


def pyplot() -> Any:
    """matplotlib.pyplot, drawing to files."""
    check_plot_support()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# -- the environment --------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


#: where a probe's findings are kept for the next run (``$TRANSPORT_CACHE_DIR``, else the user's
#: cache folder): what UCX picks depends on the boot, the network namespace, the interpreter,
#: NIXL and the UCX settings, which name the file; a probe costs a process that imports torch
#: and NIXL
CACHE_ENV = "TRANSPORT_CACHE_DIR"


def cache_dir() -> Path:
    """``$TRANSPORT_CACHE_DIR``, else ``$XDG_CACHE_HOME/transport``, else ``~/.cache/transport``."""
    if where := os.environ.get(CACHE_ENV):
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "transport"


def _probe_file() -> Path:
    """The cache file of a probe with this process's boot, namespace, interpreter, NIXL and UCX
    settings."""
    key: dict[str, Any] = {
        "python": sys.executable,
        "nixl": [_version(d) for d in ("nixl", "nixl-cu12", "nixl-cu13")],
        "ucx": sorted((k, v) for k, v in os.environ.items() if k.startswith("UCX_")),
    }
    for name, path in (("boot", "/proc/sys/kernel/random/boot_id"), ("net", "/proc/self/ns/net")):
        with contextlib.suppress(OSError):
            key[name] = os.readlink(path) if name == "net" else Path(path).read_text().strip()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"ucx-probe-{digest}.json"


def ucx_probe() -> Callable[[], dict[str, Any]]:
    """What UCX picks on this host for a put and a get: kept from an earlier run with the same
    boot, namespace, interpreter, NIXL and UCX settings (``"probe": "cached"``), else found by a
    child process that makes them with UCX_PROTO_INFO=y, and kept. The function returned waits
    for the child and gives the UCX settings with what it found."""
    info = {"UCX_TLS": os.environ.get("UCX_TLS", "default")}
    info.update({k: v for k, v in os.environ.items() if k.startswith("UCX_") and k != "UCX_TLS"})
    cache = _probe_file()
    with contextlib.suppress(OSError, ValueError):
        found = json.loads(cache.read_text())
        if isinstance(found, dict) and found.get("version"):
            return lambda: {**info, "probe": "cached", **found}
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    try:
        proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, "-m", "transport.cli.bench._systems"],
            env=env,
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except OSError:
        proc = None

    def finish() -> dict[str, Any]:
        if proc is None:
            return info
        try:
            text, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {**info, "probe": "timed out"}
        if proc.returncode != 0:
            return {**info, "probe": f"failed (exit {proc.returncode})", **parse_ucx_info(text)}
        found = parse_ucx_info(text)
        # kept for the next run; where it cannot be written, the next run probes again
        if found.get("version"):
            with contextlib.suppress(OSError):
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(found))
                tmp.replace(cache)
        return {**info, "probe": "ok", **found}

    return finish


def parse_ucx_info(text: str) -> dict[str, Any]:
    """The UCX version, the lanes of an intra-node endpoint and the protocol tables for remote
    memory writes and reads, from UCX_PROTO_INFO=y output."""
    out: dict[str, Any] = {}
    title: list[str] = []
    last, tables = "", dict[str, list[str]]()
    for raw in text.splitlines():
        line = re.sub(r"^\[[^]]*\]\s*\[[^]]*\]\s*", "", raw).strip()
        if m := re.search(r"UCX\s+INFO\s+Version (\S+)", line):
            out["version"] = m.group(1)
        if m := re.search(r"UCX\s+INFO\s+\S+ intra-node cfg#\d+ (.*)$", line):
            out["lanes"] = " ".join(m.group(1).split())
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:
            title, last = ([] if last != "title" else title) + [cells[0]], "title"
            continue
        last = "row"
        if len(cells) != 3 or cells[0] == "Range" or len(title) < 2:
            continue
        if "intra-node" in title[0] and title[1].startswith("remote memory"):
            rows = tables.setdefault(title[1], [])
            if (row := " ".join(cells)) not in rows:
                rows.append(row)
    return {**out, "protocols": tables}


def ucx_summary(ucx: dict[str, Any]) -> str:
    """``UCX 1.23.0, UCX_TLS=default (put: 0..inf zero-copy cma/memory; get: ...)``."""
    chosen, tables = [], ucx.get("protocols", {})
    for what, key in (("put", "remote memory write"), ("get", "remote memory read")):
        if names := sorted((n for n in tables if n.startswith(key)), key=lambda n: "*(" in n):
            chosen.append(f"{what}: " + ", ".join(tables[names[0]]))
    extra = f" ({'; '.join(chosen)})" if chosen else ""
    return f"UCX {ucx.get('version', '?')}, UCX_TLS={ucx['UCX_TLS']}{extra}"


def code_info() -> dict[str, Any]:
    """Which ``transport`` was measured: its directories and, in a git checkout, the commit and
    the files with uncommitted changes (others may be editing the tree being measured)."""
    import transport
    import transport.backends

    where, backends = (
        os.path.dirname(os.path.abspath(m.__file__ or "")) for m in (transport, transport.backends)
    )
    info: dict[str, Any] = {"transport": where, "backends": backends}

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", "-C", os.path.dirname(where), *args],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    if sha := git("rev-parse", "--short", "HEAD"):
        dirty = git("status", "--porcelain", "--", "transport", "backends") or ""
        dirty_files = [ln[3:] for ln in dirty.splitlines() if ln.strip()]
        info.update(commit=sha.strip(), uncommitted=dirty_files)
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

    versions = {
        "transport": getattr(transport, "__version__", None) or _version("transport"),
        "torch": torch.__version__,
        "nixl": {d: v for d in ("nixl-cu13", "nixl-cu12", "nixl") if (v := _version(d))},
        "numpy": _version("numpy"),
        "msgpack": _version("msgpack"),
        "python": platform.python_version(),
    }
    model = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        names = (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
        model = next(names, None)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = {
        "model": model or platform.processor() or None,
        "count": os.cpu_count(),
        "usable": usable,
    }
    gpu = (
        [
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
            }
            for i in range(torch.cuda.device_count())
        ]
        if torch.cuda.is_available()
        else None
    )
    return {
        "versions": versions,
        "ucx": ucx,
        "cpu": cpu,
        "gpu": gpu,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "code": code_info(),
    }
