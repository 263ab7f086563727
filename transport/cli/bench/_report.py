"""How a bench run shows itself: the progress bar on stderr and the tables on stdout (rich), and
matplotlib for ``--plot`` (optional)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

from transport.cli import CliError

SYSTEM_ORDER = ["memcpy", "gloo", "gloo-bcast", "nccl-bcast", "raw-nixl", "raw-nixl-repost",
                "ours", "ours-single", "ours-chain", "ours-tree"]  # fmt: skip
COLORS = {
    "ours": "tab:red", "ours-single": "tab:pink", "raw-nixl": "tab:blue", "raw-nixl-repost": "tab:cyan",
    "gloo": "tab:green", "gloo-bcast": "tab:olive", "nccl-bcast": "tab:purple", "memcpy": "tab:gray",
    "ours-chain": "tab:orange", "ours-tree": "tab:brown",
}  # fmt: skip


def rank(system: str) -> int:
    """A system's place in tables and legends (unknown ones last)."""
    return SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else 99


class Progress:
    """A progress bar on stderr, shown only when ``enabled`` (None: when stderr is a terminal);
    :meth:`step` starts the next of ``total`` units. Removed from the screen when the run ends."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        on = sys.stderr.isatty() if enabled is None else enabled
        console = Console(file=sys.stderr, force_terminal=on or None)
        columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))  # fmt: skip
        self.bar = RichProgress(*columns, console=console, transient=True, disable=not on)
        self.task = self.bar.add_task("", total=total)
        self.started = False

    def step(self, label: str) -> None:
        self.bar.update(self.task, advance=1 if self.started else 0, description=label)
        self.started = True

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.bar.stop()


def _console(out: IO[str]) -> Console:
    return Console(file=out, width=200, highlight=False, markup=False, emoji=False)


def text(out: IO[str], *lines: str) -> None:
    """Plain lines, as they are (no markup)."""
    for line in lines:
        print(line, file=out)


def table(
    out: IO[str], columns: Sequence[str], sections: Sequence[Sequence[Sequence[str]]]
) -> None:
    """A table of ``columns`` (a leading '<' aligns one left), rows in ``sections`` apart."""
    t = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False)
    for c in columns:
        t.add_column(c.lstrip("<"), justify="left" if c.startswith("<") else "right")
    for rows in sections:
        for i, row in enumerate(rows):
            t.add_row(*(Text(x) for x in row), end_section=i == len(rows) - 1)
    _console(out).print(t)


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
