"""One chaos run: a weight-sync job across the hosts of a cluster under a seeded schedule of faults,
its invariants checked every half second, its events in a JSON-lines log.

The job: the store on its own host (the embedded store or Redis), the trainer on its host
publishing version after version through a relay tree, a generator in each generator host, and,
while a ``churn`` fault lasts, a subscriber that joins and leaves in a loop. The run applies
each fault of the schedule (schedule.py) at its time and undoes it after its hold, checks the
reports (invariants.py) and watches every process (an exit it did not cause, a resident size over
the ceiling). After the last fault it waits, up to ``converge_by`` seconds, for every generator
to apply a version the trainer began after the faults ended.

A violation ends the run at once: it is logged, every process is asked for its flight
recorder's dump (SIGUSR1, into ``OUT/traces``), and the run exits 1 with the log and the dumps in
``OUT``.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transport.cli.chaos.invariants import Checker
from transport.cli.chaos.schedule import EventLog, Fault, read_lines
from transport.cluster import Cluster, Link

#: how often the invariants are checked and the processes looked at (seconds)
TICK = 0.5
#: how often each process's resident size is read (seconds)
RSS_EVERY = 2.0


@dataclass
class Config:
    """What a run is: its schedule's seed and span, the job's shape, and its bounds."""

    seed: int
    duration: float
    warmup: float
    generators: int
    store: str
    kinds: list[str]
    tensors: int
    numel: int
    fanout: str
    degree: int
    delta: bool
    deadline: float
    converge_by: float
    note_bound: float
    rss_ceiling_mb: int
    rate: str
    pace: float
    #: a fault planted in the job itself (``corrupt:gen0``), which the run must catch
    plant: str = ""


@dataclass
class Proc:
    """A running process of the job: its role, its Popen and report, and whether the run ended
    it (a kill, or a churner whose time is up)."""

    role: str
    popen: subprocess.Popen[Any]
    report: Path
    expected_end: bool = False
    max_rss: int = 0


@dataclass
class Outcome:
    """What the run gives back (printed, and as JSON)."""

    faults: dict[str, int] = field(default_factory=dict)
    published: int = 0
    verified: int = 0
    notes: int = 0
    violations: list[str] = field(default_factory=list)
    max_rss_mb: dict[str, float] = field(default_factory=dict)
    slowest_recovery_s: float | None = None
    converged_s: float | None = None
    delta_switches: int = 0
    folder: str = ""


class Run:
    """The cluster, the processes and the schedule of one run (see the module docstring). It
    owns every process it starts and the cluster; :meth:`execute` ends them all, whatever
    happens."""

    def __init__(self, config: Config, schedule: list[Fault], folder: Path) -> None:
        self.c, self.schedule, self.folder = config, schedule, folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "traces").mkdir(exist_ok=True)
        self.log = EventLog(folder / "events.jsonl")
        self.checker = Checker(config.note_bound)
        self.namespace = f"chaos-{os.getpid()}"
        self.secret = secrets.token_hex(16)
        self.procs: dict[str, Proc] = {}
        self.ended: list[Proc] = []
        self.incarnation: Counter[str] = Counter()
        self.delta_on = config.delta
        self.store_url = ""
        self.store_proc: subprocess.Popen[Any] | None = None
        self.cluster = Cluster(config.generators, Link(config.rate))
        self.recoveries: list[tuple[Fault, float]] = []  # (fault, when it was undone)
        self.stopped_at: dict[str, float] = {}  # a stopped generator -> since when
        self.outcome = Outcome(folder=str(folder))

    # -- processes -------------------------------------------------------------------------------

    def _host(self, role: str) -> Any:
        if role.startswith("gen"):
            return self.cluster.generator(int(role[3:]))
        return self.cluster.trainer

    def start(self, role: str, argv: list[str], host_role: str | None = None) -> Proc:
        self.incarnation[role] += 1
        report = self.folder / f"{role}.{self.incarnation[role]}.jsonl"
        args = [sys.executable, "-m", "transport.cli.chaos.roles", *argv]
        args += ["--store", self.store_url, "--namespace", self.namespace, "--report", str(report)]
        args += ["--tensors", str(self.c.tensors), "--numel", str(self.c.numel)]
        err = (self.folder / f"{role}.log").open("a")
        env = {
            "TRANSPORT_CHAOS_SECRET": self.secret,
            "TRANSPORT_TRACE_DIR": str(self.folder / "traces" / role),
            "OMP_NUM_THREADS": "1",
            "TRANSPORT_CHAOS_PLANT": self.c.plant,
        }
        popen = self.cluster.start(
            self._host(host_role or role),
            args,
            env=env,
            stdin=subprocess.PIPE if role == "trainer" else subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
        err.close()
        proc = Proc(role, popen, report)
        self.procs[role] = proc
        self.checker.started(role, popen.pid, report)
        self.log.write("start", role=role, pid=popen.pid, report=report.name)
        return proc

    def start_trainer(self) -> None:
        first = max(self.checker.began, default=0) + 1
        argv = ["trainer", "--first", str(first), "--fanout", self.c.fanout]
        argv += ["--degree", str(self.c.degree), "--deadline", str(self.c.deadline)]
        argv += ["--pace", str(self.c.pace)] + ["--delta"] * self.delta_on
        self.start("trainer", argv)

    def start_generator(self, role: str) -> None:
        self.start(role, ["generator", "--name", role])

    def kill(self, role: str) -> None:
        proc = self.procs.pop(role, None)
        if proc is None:
            return
        proc.expected_end = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, signal.SIGCONT)
            proc.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(30)
        self.checker.ended(proc.popen.pid)
        self.ended.append(proc)
        self.log.write("end", role=role, pid=proc.popen.pid, by="the run")

    def wait_ready(self, roles: list[str], timeout: float = 240.0) -> None:
        end = time.monotonic() + timeout
        waiting = set(roles)
        while waiting:
            for role in list(waiting):
                proc = self.procs[role]
                if any(line.get("ready") for _, line in read_lines(proc.report, 0)):
                    waiting.discard(role)
                elif proc.popen.poll() is not None:
                    raise RuntimeError(f"{role} ended before it was ready: see {role}.log")
            if time.monotonic() > end:
                raise RuntimeError(f"{sorted(waiting)} not ready within {timeout:.0f} s")
            time.sleep(TICK)  # reports are files: nothing to wait on

    def start_store(self) -> None:
        # seen from its own host: a restart waits for nothing the schedule may have cut
        self.store_url = self.cluster.start_store(self.c.store, probe_from=self.cluster.store_host)
        self.store_proc = proc = self.cluster.store_process
        self.log.write("store", url=self.store_url, pid=None if proc is None else proc.pid)

    def stop_store(self) -> None:
        proc, self.store_proc = self.store_proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)

    # -- faults ----------------------------------------------------------------------------------

    def begin(self, f: Fault) -> None:
        extra: dict[str, Any] = {}
        if f.kind == "kill" and f.target in self.procs:
            extra["pid"] = self.procs[f.target].popen.pid
            self.kill(f.target)
        elif f.kind == "stop" and f.target in self.procs:
            extra["pid"] = self.procs[f.target].popen.pid
            os.kill(extra["pid"], signal.SIGSTOP)
            self.stopped_at[f.target] = time.monotonic()
        elif f.kind == "cut":
            self.cluster.cut(self.cluster.hosts[f.target])
        elif f.kind in ("loss", "reorder", "duplicate"):
            self.cluster.shape(self.cluster.hosts[f.target], self._faulty_link(f))
        elif f.kind in ("redis", "store_host"):
            self.stop_store()
        elif f.kind == "trainer_kill":
            extra["mid_publish"] = self._publishing(timeout=5.0)
            self.kill("trainer")
        elif f.kind == "churn":
            self.start(
                "churn", ["churner", "--name", "churn", "--seconds", str(f.hold)], f.target
            ).expected_end = True
        elif f.kind == "delta":
            self.delta_on = not self.delta_on
            self._tell_trainer()
        self.log.fault(f, "begin", **extra)

    def undo(self, f: Fault) -> None:
        extra: dict[str, Any] = {}
        if f.kind == "kill":
            self.start_generator(f.target)
            extra["pid"] = self.procs[f.target].popen.pid
        elif f.kind == "stop":
            proc = self.procs.get(f.target)
            since = self.stopped_at.pop(f.target, None)
            if proc is not None and since is not None:
                os.kill(proc.popen.pid, signal.SIGCONT)
                self.checker.stopped(f.target, since, time.monotonic())
        elif f.kind == "cut":
            self.cluster.cut(self.cluster.hosts[f.target], cut=False)
        elif f.kind in ("loss", "reorder", "duplicate"):
            self.cluster.shape(self.cluster.hosts[f.target], Link(self.c.rate))
        elif f.kind in ("redis", "store_host"):
            self.start_store()
        elif f.kind == "trainer_kill":
            self.start_trainer()
        elif f.kind == "delta":
            self.delta_on = not self.delta_on
            self._tell_trainer()
        self.log.fault(f, "end", **extra)
        self.recoveries.append((f, time.monotonic()))

    def _faulty_link(self, f: Fault) -> Link:
        """The link of a loss, reorder or duplicate fault: the run's rate and the fault's share."""
        rate = self.c.rate
        if f.kind == "loss":
            return Link(rate, loss=f.amount)
        if f.kind == "reorder":
            return Link(rate, reorder=f.amount)
        return Link(rate, duplicate=f.amount)

    def _publishing(self, timeout: float) -> int | None:
        """Wait (up to ``timeout``) until the trainer is inside a publish: its report's last line
        begins a version; that version (None: it was not, in time)."""
        proc = self.procs.get("trainer")
        end = time.monotonic() + timeout
        while proc is not None and time.monotonic() < end:
            last: dict[str, Any] = {}
            for _, line in read_lines(proc.report, 0):
                last = line
            if "begin" in last:
                return int(last["begin"])
            time.sleep(0.02)  # the report is a file: nothing to wait on
        return None

    def _tell_trainer(self) -> None:
        proc = self.procs.get("trainer")
        if proc is not None and proc.popen.stdin is not None:
            with contextlib.suppress(OSError):
                proc.popen.stdin.write(f"delta {'on' if self.delta_on else 'off'}\n")
                proc.popen.stdin.flush()

    # -- watching --------------------------------------------------------------------------------

    def watch(self, last_rss: float) -> float:
        """One tick: the reports checked, every process looked at; returns when RSS was read."""
        for v in self.checker.poll():
            self.violate(v)
        for role, proc in list(self.procs.items()):
            code = proc.popen.poll()
            if code is None:
                continue
            self.procs.pop(role)
            self.checker.ended(proc.popen.pid)
            self.ended.append(proc)
            self.log.write("end", role=role, pid=proc.popen.pid, code=code)
            if not proc.expected_end or code != 0:
                tail = (self.folder / f"{role}.log").read_text(errors="replace")[-1500:]
                self.violate(
                    f"{role} (pid {proc.popen.pid}) ended by itself, status {code}: {tail}"
                )
        if self.store_proc is not None and self.store_proc.poll() is not None:
            self.violate(
                f"the {self.c.store} store ended by itself, status {self.store_proc.poll()}"
            )
            self.store_proc = None
        if time.monotonic() - last_rss < RSS_EVERY:
            return last_rss
        for role, proc in self.procs.items():
            rss = _rss(proc.popen.pid)
            proc.max_rss = max(proc.max_rss, rss)
            key = "generator" if role.startswith("gen") else role
            mb = rss / (1 << 20)
            self.outcome.max_rss_mb[key] = max(self.outcome.max_rss_mb.get(key, 0.0), round(mb, 1))
            if mb > self.c.rss_ceiling_mb:
                self.violate(f"{role} holds {mb:.0f} MiB, over the ceiling {self.c.rss_ceiling_mb}")
        return time.monotonic()

    def violate(self, what: str) -> None:
        if what not in self.outcome.violations:
            self.outcome.violations.append(what)
            self.log.write("violation", what=what)

    def dump_all(self, timeout: float = 20.0) -> None:
        """Every live process writes its flight recorder (SIGUSR1); waits until each dump is
        there (a file naming its pid), at most ``timeout`` s, and logs the processes without."""
        asked = {}
        for role, proc in self.procs.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.popen.pid, signal.SIGCONT)
                os.kill(proc.popen.pid, signal.SIGUSR1)
                asked[role] = proc.popen.pid
        end = time.monotonic() + timeout
        while asked and time.monotonic() < end:
            for role, pid in list(asked.items()):
                if any((self.folder / "traces" / role).glob(f"*.{pid}.*.jsonl")):
                    del asked[role]
            time.sleep(TICK)  # dumps are files: nothing to wait on
        if asked:
            self.log.write("no dump", processes=asked)

    # -- the run ---------------------------------------------------------------------------------

    def execute(self) -> Outcome:
        self.log.write("run", **vars(self.c), faults=len(self.schedule))
        try:
            with self.cluster:
                self._job()
        finally:
            for proc in list(self.procs.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.popen.pid, signal.SIGCONT)
            self.log.write("done", violations=len(self.outcome.violations))
            self.log.close()
        return self.outcome

    def _job(self) -> None:
        gens = [f"gen{i}" for i in range(self.c.generators)]
        self.start_store()
        self.start_trainer()
        for g in gens:
            self.start_generator(g)
        self.wait_ready(["trainer", *gens])
        self.log.t0 = time.monotonic()  # the schedule's clock starts with the job ready
        self.log.write("ready")
        events: list[tuple[float, int, str, Fault]] = []
        for f in self.schedule:
            heapq.heappush(events, (self.c.warmup + f.at, f.seq, "begin", f))
        last_rss = 0.0
        counts: Counter[str] = Counter()
        while events and not self.outcome.violations:
            at, _, phase, f = events[0]
            if self.log.now() >= at:
                for v in self.checker.poll():  # what happened before the fault is judged first
                    self.violate(v)
                if self.outcome.violations:
                    break
                heapq.heappop(events)
                if phase == "begin":
                    self.begin(f)
                    counts[f.kind] += 1
                    heapq.heappush(events, (at + f.hold, f.seq, "end", f))
                else:
                    self.undo(f)
            else:
                last_rss = self.watch(last_rss)
                time.sleep(min(TICK, max(0.0, at - self.log.now())))
        self.outcome.faults = dict(counts)
        if not self.outcome.violations:
            self._converge(gens, last_rss)
        if self.outcome.violations:
            self.dump_all()
        self._summarize()

    def _converge(self, gens: list[str], last_rss: float) -> None:
        """After the last fault: until every generator applied a version the trainer began
        after it, or the bound (a violation)."""
        calm_from = time.monotonic()
        self.log.write("calm")
        while not self.outcome.violations:
            last_rss = self.watch(last_rss)
            target = self.checker.first_begun_after(calm_from)
            if target is not None and not self.checker.holding(gens, target):
                self.outcome.converged_s = round(time.monotonic() - calm_from, 2)
                self.log.write("converged", version=target, s=self.outcome.converged_s)
                break
            if time.monotonic() - calm_from > self.c.converge_by:
                behind = self.checker.holding(gens, target if target is not None else 1 << 62)
                self.violate(
                    f"not converged {self.c.converge_by:.0f} s after the last fault: version "
                    f"{target} not held by {behind}"
                )
                break
            time.sleep(TICK)

    def _summarize(self) -> None:
        o, ch = self.outcome, self.checker
        o.published = sum(1 for r in ch.published.values() if r.get("status"))
        o.verified, o.notes, o.delta_switches = ch.verified, ch.notes_checked, ch.delta_switches
        slowest = 0.0
        for f, undone in self.recoveries:
            targets = [f.target] if f.target.startswith("gen") else []
            if f.target in ("trainer", "store"):
                targets = [f"gen{i}" for i in range(self.c.generators)]
            for g in targets:
                at = ch.recovered(g, undone)
                if at is not None:
                    slowest = max(slowest, at - undone)
        o.slowest_recovery_s = round(slowest, 2)


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def print_outcome(o: Outcome) -> None:
    print(json.dumps(vars(o), indent=1))
