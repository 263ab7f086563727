"""The processes of a chaos run, each in a host of the cluster: the trainer, the generators and
the churner (``python -m transport.cli.chaos.roles ROLE ...``). Each appends what it does to a
JSON-lines report of its own, one ``os.write`` per line (a killed process leaves whole lines),
with ``t`` from CLOCK_MONOTONIC, which every process of the machine shares.

* The **trainer** publishes version after version of :class:`~.content.Content`, with a digest
  of what it published, then puts a small tensor with a notification to each generator that
  took the version (the notification must reach it). A line on its stdin switches delta
  updates (``delta on`` / ``delta off``).
* A **generator** applies every version it can, checks every element against what the version
  must hold and digests what it applied; it reports each notification and every call that took
  longer than its timeout allows. A call still running half a second before that bound has
  every thread's stack written next to the report (``REPORT.stacks``): what it waited on.
* The **churner** joins the group and leaves it again, under one name, until its time is up,
  checking what it received in between.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import transport
from transport import TransferTimeout, TransportError
from transport.cli.chaos.content import Content, digest

#: what a call may take beyond its own timeout before it counts as blocked past its deadline
SLACK = 5.0
#: a generator's wait for the next version (seconds)
WAIT = 1.0
#: the small tensor every notified put carries
PROBE = "probe"
T = TypeVar("T")


class Report:
    """One process's report file: each line whole, with the time and the process."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def __call__(self, **fields: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())


class StackWatch:
    """Writes every thread's stack to a file when a call runs past a bound: what it waited on.

    It owns one daemon thread that holds the interpreter lock while it reads the stacks
    (``sys._current_frames``), so reading them is safe whatever the other threads do (the
    faulthandler module's watchdog reads them without that lock, and crashed a generator that
    resumed from SIGSTOP while it wrote). Rules: one call watched at a time; :meth:`arm` before
    it, :meth:`disarm` after; a call that ends first writes nothing.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._cond = threading.Condition()
        self._due: float | None = None
        threading.Thread(target=self._run, name="chaos-stack-watch", daemon=True).start()

    def arm(self, seconds: float) -> None:
        with self._cond:
            self._due = time.monotonic() + seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._due = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._due is None or time.monotonic() < self._due:
                    left = None if self._due is None else self._due - time.monotonic()
                    self._cond.wait(left)
                self._due = None
            self._write()

    def _write(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        parts = [f"-- {time.monotonic():.3f}: a call ran past its bound\n"]
        for ident, frame in sys._current_frames().items():  # noqa: SLF001 - documented in sys
            if ident != me:
                parts.append(f"Thread {names.get(ident, ident)}:\n")
                parts.extend(traceback.format_stack(frame))
        with open(self._path, "a") as f:
            f.write("".join(parts))


def _join(a: argparse.Namespace, name: str, report: Report) -> transport.Transport:
    """A Transport in the run's namespace, tried again until the store answers (it may be
    restarting)."""
    while True:
        try:
            return transport.Transport(
                name, store=a.store, namespace=a.namespace, secret=a.secret, timeout=a.timeout
            )
        except TransportError as e:
            report(error=f"join: {type(e).__name__}: {e}"[:300])
            time.sleep(0.5)  # the store is restarting: a retry's pause


def _until_made(make: Callable[[], T], what: str, report: Report) -> T:
    """``make()``, tried again while the store cannot be reached (it may be restarting)."""
    while True:
        try:
            return make()
        except TransportError as e:
            report(error=f"{what}: {type(e).__name__}: {e}"[:300])
            time.sleep(0.5)  # the store is restarting: a retry's pause


def generator(a: argparse.Namespace) -> int:
    report = Report(a.report)
    content = Content(a.tensors, a.numel)
    tensors = content.empty()
    t = _join(a, a.name, report)
    _until_made(lambda: t.expose(PROBE, torch.zeros(16)), "expose", report)
    sub = _until_made(
        lambda: transport.WeightSubscriber(t, tensors, group="chaos", delta=True),
        "subscribe",
        report,
    )
    report(ready=True)
    # --plant corrupt:NAME: this generator flips a bit of what it applied (the run must catch it)
    planted = os.environ.get("TRANSPORT_CHAOS_PLANT") == f"corrupt:{a.name}"
    applied, last_tick = -1, time.monotonic()
    stacks = StackWatch(a.report + ".stacks")
    while True:
        began = time.monotonic()
        stacks.arm(WAIT + SLACK - 0.5)
        try:
            sub.wait_for_version(applied + 1, timeout=WAIT)
            version = sub.apply()
        except TransferTimeout:
            version = applied
        except TransportError as e:
            report(error=f"{type(e).__name__}: {e}"[:300])
            version = applied
        finally:
            stacks.disarm()
        took = time.monotonic() - began
        if took > WAIT + SLACK:
            report(slow="wait_for_version+apply", began=began, took=round(took, 3))
        if version > applied:
            if planted and version >= 3:
                tensors[content.names()[0]].view(torch.int32)[7] ^= 1
            bad = content.mismatches(version, tensors)
            torn = content.which(version, tensors) if bad else {}
            report(v=version, bad=bad, digest=digest(tensors), torn=torn)
            applied = version
        for note in t.notifications(timeout=0):
            report(note=note.payload.decode(errors="replace"), sender=note.peer)
        if time.monotonic() - last_tick > 2.0:
            report(tick=applied)  # alive, and how far it got
            last_tick = time.monotonic()


def trainer(a: argparse.Namespace) -> int:
    report = Report(a.report)
    content = Content(a.tensors, a.numel)
    state = content.empty()
    t = _join(a, "trainer", report)
    probe = torch.zeros(16)
    t.register(probe, PROBE)
    delta = {"on": a.delta}
    pub = _until_made(
        lambda: transport.WeightPublisher(
            t, state, group="chaos", fanout=a.fanout, degree=a.degree, delta=a.delta
        ),
        "publish",
        report,
    )

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() in ("delta on", "delta off"):
                delta["on"] = line.strip() == "delta on"

    threading.Thread(target=commands, daemon=True).start()
    report(ready=True)
    version = a.first
    while True:
        if pub.delta != delta["on"]:
            pub.delta = delta["on"]
            report(delta=delta["on"])
        content.write(version, state)
        report(begin=version, digest=digest(state))
        began = time.monotonic()
        try:
            r = pub.publish(version, timeout=a.deadline).wait(a.deadline + SLACK)
        except Exception as e:  # a publish that fails says why; the run goes on
            report(v=version, error=f"{type(e).__name__}: {e}"[:300])
            version += 1
            continue
        took = time.monotonic() - began
        report(
            v=version,
            status=r.status,
            reasons={k: v[:200] for k, v in r.reasons.items()},
            patched=r.patched,
            via=r.via,
            took=round(took, 3),
        )
        if took > a.deadline + SLACK:
            report(slow="publish", began=began, took=round(took, 3))
        for gen in r.done:
            probe.fill_(version)
            try:
                t.put(probe, gen, PROBE, notify=f"v{version}".encode()).wait(a.deadline)
                report(put=gen, v=version)
            except TransportError as e:
                report(put_error=gen, v=version, error=f"{type(e).__name__}: {e}"[:200])
        version += 1
        time.sleep(a.pace)  # the pace of a training step


def churner(a: argparse.Namespace) -> int:
    report = Report(a.report)
    content = Content(a.tensors, a.numel)
    end = time.monotonic() + a.seconds
    cycle = 0
    while time.monotonic() < end:
        cycle += 1
        tensors = content.empty()
        began = time.monotonic()
        t = _join(a, a.name, report)
        try:
            sub = transport.WeightSubscriber(t, tensors, group="chaos")
            try:
                got = sub.wait_for_version(1, timeout=5.0)
                version = sub.apply()
                report(cycle=cycle, v=version, bad=content.mismatches(version, tensors), got=got)
            except TransferTimeout:
                report(cycle=cycle, v=None)
            sub.close()
        except TransportError as e:
            report(cycle=cycle, error=f"{type(e).__name__}: {e}"[:300])
        finally:
            closing = time.monotonic()
            t.close()
            took = time.monotonic() - closing
            if took > a.timeout + SLACK:
                report(slow="close", began=closing, took=round(took, 3))
        report(cycle_s=round(time.monotonic() - began, 3))
    report(done=cycle)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m transport.cli.chaos.roles")
    p.add_argument("role", choices=("trainer", "generator", "churner"))
    p.add_argument("--name", default="")
    p.add_argument("--store", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--numel", type=int, default=1 << 18)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--deadline", type=float, default=10.0)
    p.add_argument("--fanout", default="tree")
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--delta", action="store_true")
    p.add_argument("--first", type=int, default=1)
    p.add_argument("--pace", type=float, default=0.2)
    p.add_argument("--seconds", type=float, default=10.0)
    a = p.parse_args(argv)
    a.secret = os.environ.get("TRANSPORT_CHAOS_SECRET") or None
    torch.set_num_threads(1)
    return {"trainer": trainer, "generator": generator, "churner": churner}[a.role](a)


if __name__ == "__main__":
    sys.exit(main())
