"""What a chaos run checks all the time, from the processes' reports (roles.py) and what the run
did to them (run.py tells it): a :class:`Checker` owns the reports' read offsets, the
incarnations of each role, the windows in which a process was stopped, and what it has checked.

The rules, each a violation when broken:

* **bytes**: every version a generator (or the churner) reports applied holds, element by
  element, what that version must hold (``bad == 0``), and its digest is the trainer's digest of
  what it published as that version;
* **order**: an incarnation never applies an older version after a newer one (no version is
  presented torn or taken back);
* **deadlines**: no call took longer than its timeout and the slack (a ``slow`` line), except
  while its process was stopped;
* **notifications**: every notified put the trainer saw complete reaches the generator it was
  for: the incarnation alive when the put completed reports it, unless it is killed first
  (checked once that incarnation has reported for ``note_bound`` seconds after the put);
* **deaths** and **memory** come from run.py (a process that ended without being killed; a
  resident size above the role's ceiling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transport.cli.chaos.schedule import read_lines


@dataclass
class Incarnation:
    """One process of a role: its report file, when it started and ended (monotonic seconds),
    what it applied (version -> monotonic time), the notifications it reported, and the last
    time it reported anything."""

    role: str
    pid: int
    report: Path
    started: float
    ended: float | None = None
    offset: int = 0
    applied: dict[int, float] = field(default_factory=dict)
    notes: set[str] = field(default_factory=set)
    last_line: float = 0.0
    newest: int = -1


@dataclass
class Put:
    """A notified put the trainer saw complete: to ``gen``, of version ``v``, at ``t``."""

    gen: str
    v: int
    t: float


class Checker:
    """See the module docstring. Not thread-safe: run.py calls it from one thread."""

    def __init__(self, note_bound: float) -> None:
        self.note_bound = note_bound
        self.incarnations: list[Incarnation] = []
        self.stops: dict[str, list[tuple[float, float]]] = {}
        #: the trainer's digest of each version it began, and when it began it
        self.digests: dict[int, str] = {}
        self.began: dict[int, float] = {}
        #: the trainer's publishes: version -> its result line
        self.published: dict[int, dict[str, Any]] = {}
        self.puts: list[Put] = []
        self.unverified: list[tuple[str, int, str]] = []  # (role, version, digest)
        self.violations: list[str] = []
        self.verified = 0
        self.notes_checked = 0
        self.delta_switches = 0

    # -- what run.py tells -----------------------------------------------------------------------

    def started(self, role: str, pid: int, report: Path) -> None:
        self.incarnations.append(Incarnation(role, pid, report, time.monotonic()))

    def ended(self, pid: int) -> None:
        for inc in self.incarnations:
            if inc.pid == pid and inc.ended is None:
                self._read(inc)
                inc.ended = time.monotonic()

    def stopped(self, role: str, begin: float, end: float) -> None:
        self.stops.setdefault(role, []).append((begin, end))

    # -- reading ---------------------------------------------------------------------------------

    def poll(self) -> list[str]:
        """Read what every process reported since the last poll and check it; the violations
        found now."""
        before = len(self.violations)
        for inc in self.incarnations:
            if inc.role == "trainer":
                self._read(inc)
        for inc in self.incarnations:
            if inc.role != "trainer":
                self._read(inc)
        self._check_digests()
        self._check_notes()
        return self.violations[before:]

    def _read(self, inc: Incarnation) -> None:
        for offset, line in read_lines(inc.report, inc.offset):
            inc.offset = offset
            inc.last_line = max(inc.last_line, float(line.get("t", 0.0)))
            if inc.role == "trainer":
                self._trainer_line(line)
            else:
                self._generator_line(inc, line)

    def _trainer_line(self, line: dict[str, Any]) -> None:
        if "begin" in line:
            self.digests[line["begin"]] = line["digest"]
            self.began[line["begin"]] = line["t"]
        elif "put" in line:
            self.puts.append(Put(line["put"], line["v"], line["t"]))
        elif "status" in line:
            self.published[line["v"]] = line
        elif "delta" in line:
            self.delta_switches += 1
        elif "slow" in line:
            self.violations.append(f"the trainer's {line['slow']} took {line['took']} s")

    def _generator_line(self, inc: Incarnation, line: dict[str, Any]) -> None:
        who = f"{inc.role} (pid {inc.pid})"
        if "note" in line:
            inc.notes.add(line["note"])
        elif "slow" in line:
            if not self._was_stopped(inc.role, line["began"], line["began"] + line["took"]):
                self.violations.append(f"{who}: {line['slow']} took {line['took']} s")
        elif line.get("v") is not None and "bad" in line:
            v = int(line["v"])
            if line["bad"]:
                self.violations.append(
                    f"{who} applied version {v} with {line['bad']} wrong elements: "
                    f"{line.get('torn', '')}"
                )
            if v < inc.newest:
                self.violations.append(f"{who} applied version {v} after version {inc.newest}")
            inc.newest = max(inc.newest, v)
            inc.applied[v] = line["t"]
            if "digest" in line:
                self.unverified.append((who, v, line["digest"]))
            else:
                self.verified += 1

    def _was_stopped(self, role: str, begin: float, end: float) -> bool:
        return any(b < end and begin < e for b, e in self.stops.get(role, []))

    def _check_digests(self) -> None:
        waiting = []
        for who, v, d in self.unverified:
            if v not in self.digests:
                waiting.append((who, v, d))
            elif self.digests[v] != d:
                self.violations.append(
                    f"{who} applied version {v} with digest {d}; the trainer published "
                    f"{self.digests[v]}"
                )
            else:
                self.verified += 1
        self.unverified = waiting

    def _check_notes(self) -> None:
        pending = []
        for put in self.puts:
            inc = self._alive_at(put.gen, put.t)
            if inc is None or inc.ended is not None:
                continue  # killed before it could tell (or the put raced its start)
            if f"v{put.v}" in inc.notes:
                self.notes_checked += 1
            elif inc.last_line >= put.t + self.note_bound:
                self.violations.append(
                    f"{put.gen} (pid {inc.pid}) never reported the notification of version "
                    f"{put.v}'s put, which completed {self.note_bound:.0f}+ s before its last report"
                )
            else:
                pending.append(put)
        self.puts = pending

    def _alive_at(self, role: str, t: float) -> Incarnation | None:
        for inc in self.incarnations:
            if inc.role == role and inc.started <= t and (inc.ended is None or t < inc.ended):
                return inc
        return None

    # -- the end ---------------------------------------------------------------------------------

    def live(self, role: str) -> Incarnation | None:
        alive = [i for i in self.incarnations if i.role == role and i.ended is None]
        return alive[-1] if alive else None

    def holding(self, roles: list[str], version: int) -> dict[str, int]:
        """Each role's live incarnation's newest applied version, for those below ``version``."""
        behind = {}
        for role in roles:
            inc = self.live(role)
            newest = -1 if inc is None else inc.newest
            if newest < version:
                behind[role] = newest
        return behind

    def first_begun_after(self, t: float) -> int | None:
        later = [v for v, at in self.began.items() if at >= t]
        return min(later) if later else None

    def recovered(self, role: str, after: float) -> float | None:
        """When ``role`` first applied a version the trainer began after ``after`` (None: not
        yet)."""
        times = []
        for inc in self.incarnations:
            if inc.role == role:
                times += [at for v, at in inc.applied.items() if self.began.get(v, -1.0) >= after]
        return min(times) if times else None
