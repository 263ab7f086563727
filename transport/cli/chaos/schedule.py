"""The faults of a chaos run: planned from a seed, written to the event log as they happen, and
read back from a log to run the same schedule again (``--replay``).

A :class:`Fault` begins ``at`` seconds into the run and is undone ``hold`` seconds later (a
killed process restarted, a stopped one continued, a link restored). Faults overlap: each holds
a *resource* (a generator's process, a host's link, the store, the trainer) and only faults on
different resources run at once, so a generator may be stopped while the trainer's link drops
packets and the store restarts.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: every kind a run can inject, with (shortest, longest) hold in seconds
HOLDS: dict[str, tuple[float, float]] = {
    "kill": (0.5, 3.0),  # SIGKILL of a generator, restarted after the hold
    "stop": (2.0, 8.0),  # SIGSTOP of a generator, SIGCONT after the hold
    "cut": (2.0, 8.0),  # a host's link down
    "loss": (3.0, 10.0),  # a host's link drops a share of its packets
    "reorder": (3.0, 10.0),  # a host's link holds back a share of its packets
    "duplicate": (3.0, 10.0),  # a host's link sends a share of its packets twice
    "redis": (0.0, 2.0),  # Redis killed, restarted empty
    "store_host": (0.0, 2.0),  # the embedded store's process killed, started again empty
    "trainer_kill": (0.5, 2.0),  # the trainer killed mid-publish, restarted
    "churn": (5.0, 15.0),  # a subscriber joins and leaves in a loop
    "delta": (5.0, 20.0),  # the publisher's delta updates switched, and back
}
#: the kinds that need the Redis store, and those that need the embedded one
REDIS_ONLY, EMBEDDED_ONLY = {"redis"}, {"store_host"}
#: the share of packets (percent) a loss, reorder or duplicate fault takes
AMOUNTS = {"loss": (1.0, 8.0), "reorder": (5.0, 25.0), "duplicate": (5.0, 25.0)}
#: gap between two faults' beginnings (seconds)
GAP = (0.3, 2.0)


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on ``target`` (a host role such as ``gen2``, or ``store``,
    ``trainer``), from ``at`` seconds into the run for ``hold`` seconds; ``amount`` is the
    percent of packets for link faults (0 otherwise). ``seq`` numbers it in its schedule."""

    seq: int
    at: float
    kind: str
    target: str
    hold: float
    amount: float = 0.0

    @property
    def resource(self) -> str:
        """What the fault holds while it lasts (see the module docstring)."""
        if self.kind in ("kill", "stop"):
            return f"proc:{self.target}"
        if self.kind in ("cut", "loss", "reorder", "duplicate"):
            return f"link:{self.target}"
        if self.kind == "trainer_kill":
            return "proc:trainer"
        if self.kind in ("redis", "store_host"):
            return "store"
        return self.kind


def kinds_for(store: str, wanted: Sequence[str] | None = None) -> list[str]:
    """The kinds a run with ``store`` (``redis`` or ``tcp``) injects, ``wanted`` or all."""
    out = []
    for kind in wanted or list(HOLDS):
        if kind not in HOLDS:
            raise ValueError(f"unknown fault kind {kind!r}; the kinds are {', '.join(HOLDS)}")
        if (kind in REDIS_ONLY and store != "redis") or (kind in EMBEDDED_ONLY and store != "tcp"):
            continue
        out.append(kind)
    if not out:
        raise ValueError(f"no fault kind of {list(wanted or [])} applies to a {store} store")
    return out


def plan(
    seed: int,
    begin: float,
    end: float,
    kinds: Sequence[str],
    generators: int,
) -> list[Fault]:
    """Faults from ``begin`` to ``end`` seconds into the run (each one undone by ``end``),
    the same for the same arguments."""
    rng = random.Random(seed)
    link_hosts = [f"gen{i}" for i in range(generators)] + ["trainer"]
    busy: dict[str, float] = {}
    out: list[Fault] = []
    at = begin
    while True:
        at = round(at + rng.uniform(*GAP), 3)
        for _ in range(8):  # a few tries to find a kind whose resource is free
            kind = rng.choice(list(kinds))
            lo, hi = HOLDS[kind]
            hold = round(rng.uniform(lo, hi), 3)
            if kind in ("kill", "stop"):
                target = f"gen{rng.randrange(generators)}"
            elif kind in ("cut", "loss", "reorder", "duplicate"):
                target = rng.choice(link_hosts)
            elif kind in ("redis", "store_host"):
                target = "store"
            elif kind == "trainer_kill":
                target = "trainer"
            elif kind == "churn":
                target = f"gen{rng.randrange(generators)}"
            else:
                target = "trainer"
            amount = round(rng.uniform(*AMOUNTS[kind]), 1) if kind in AMOUNTS else 0.0
            fault = Fault(len(out), at, kind, target, hold, amount)
            if busy.get(fault.resource, 0.0) <= at and at + hold <= end:
                busy[fault.resource] = at + hold + 0.5
                out.append(fault)
                break
        if at >= end:
            return out


def from_log(path: Path) -> tuple[dict[str, Any], list[Fault]]:
    """The run header and the schedule of an event log (its faults' beginnings)."""
    header: dict[str, Any] = {}
    faults = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue  # the half line of a run that was killed
        if e.get("event") == "run":
            header = e
        elif e.get("event") == "fault" and e.get("phase") == "begin":
            faults.append(
                Fault(e["seq"], e["at"], e["kind"], e["target"], e["hold"], e.get("amount", 0.0))
            )
    if not header:
        raise ValueError(f"{path} is not a chaos run's event log (it has no run header)")
    return header, sorted(faults, key=lambda f: f.seq)


class EventLog:
    """The run's JSON-lines event log: one line per event, written whole and flushed (a killed
    run leaves every event before its end), each with ``t``, seconds since the run began.
    Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._file = path.open("a", buffering=1)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"t": self.now(), "event": event, **fields}
        with self._lock:
            self._file.write(json.dumps(rec) + "\n")
        return rec

    def fault(self, fault: Fault, phase: str, **fields: Any) -> dict[str, Any]:
        return self.write("fault", phase=phase, **asdict(fault), **fields)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_lines(path: Path, offset: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The whole JSON lines of ``path`` from byte ``offset``, each with the offset after it (a
    line still being written is left for the next read)."""
    if not path.exists():
        return
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            return
        line = data[pos:nl]
        pos = nl + 1
        try:
            yield offset + pos, json.loads(line)
        except ValueError:
            yield offset + pos, {"event": "garbled", "line": line[:200].decode(errors="replace")}
