"""Runs every decoder's fuzz target (fuzz_targets.py) under atheris, coverage-guided, for a given
time each, from the seed corpus in ``corpus/<target>/``, and reports per target the inputs tried,
what it found and the line coverage of the decoder's code (replayed under coverage.py).

A finding is a crash: an exception outside the target's error tree, a decoder that accepted what
breaks its own rules, a hang (an input that takes more than ``--input-timeout`` seconds), or an
input whose decoding allocated more than the target's budget at its peak (tracemalloc). libFuzzer
writes each finding's input under ``OUT/findings/<target>/``; fixed, it belongs in the corpus as
``regression-<sha1>`` (tests/fuzz/test_fuzz.py replays every file of the corpus).

    python tests/fuzz/run.py --seconds 120 --jobs 2 --json fuzz.json      # every target
    python tests/fuzz/run.py --seconds 10 --targets heartbeat,delta_blob  # some of them
    python tests/fuzz/run.py --runs 300 --seconds 600  # 300 inputs each, however long they take
    python tests/fuzz/run.py --write-seeds    # rewrite the seed corpus from the encoders
    python tests/fuzz/run.py --replay FILE --targets delta_blob   # one input, its traceback

Each target runs in a child forked from this process after the library was imported under
atheris's instrumentation (once for all). Coverage is measured in a separate process that runs
the encoders (the seeds) and replays the seed corpus and what the fuzzer added to it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
#: the modules atheris instruments (the library's; torch, msgpack and vLLM are not ours)
INSTRUMENTED = ("transport",)


@dataclass
class Outcome:
    """What one target's run gave."""

    target: str
    seconds: float
    inputs: int = 0
    corpus: int = 0
    findings: list[str] = field(default_factory=list)
    exit: int | None = None
    error: str = ""
    coverage: float | None = None
    lines: int = 0
    missing: dict[str, list[int]] = field(default_factory=dict)


class BudgetExceeded(MemoryError):
    """An input made its decoder allocate more than the target's budget (a finding)."""


def _import_targets(instrument: bool, selected: list[str] | None = None) -> Any:
    import torch  # noqa: F401 (imported outside the instrumentation: it is not ours)

    if instrument:
        import atheris

        # atheris names every module it instruments on stderr: a hundred lines of noise
        saved = os.dup(2)
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        try:
            with atheris.instrument_imports(include=list(INSTRUMENTED)):
                import fuzz_targets

                for name, module in fuzz_targets.LAZY.items():
                    if selected is None or name in selected:
                        importlib.import_module(module)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    else:
        import fuzz_targets
    return fuzz_targets


def _checked(target: Any, budget: bool, findings: Path | None = None) -> Any:
    """``target.run`` with the rules of a finding: allowed errors pass, the budget holds. An
    input that breaks one is written under ``findings`` (with its traceback) and its error
    raised on (libFuzzer then stops)."""
    import tracemalloc

    allowed = target.allowed

    def one(data: bytes) -> None:
        try:
            _one(data)
        except Exception:
            if findings is not None:
                name = f"crash-{hashlib.sha1(data).hexdigest()}"
                (findings / name).write_bytes(data)
                (findings / f"{name}.txt").write_text(traceback.format_exc())
            raise

    def _one(data: bytes) -> None:
        if budget:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
        try:
            target.run(data)
        except allowed:
            pass
        if budget:
            peak = tracemalloc.get_traced_memory()[1] - before
            if peak > target.budget:
                raise BudgetExceeded(
                    f"{target.name}: decoding {len(data)} bytes allocated {peak} bytes at the "
                    f"peak; the budget is {target.budget}"
                )

    if budget:
        tracemalloc.start()
    return one


def _child(target: Any, work: Path, findings: Path, args: argparse.Namespace) -> None:
    """In the forked child: fuzz one target until the time is up (libFuzzer exits)."""
    import atheris

    seeds = CORPUS / target.name
    if not seeds.is_dir():  # a target with no corpus kept (the planted findings)
        seeds = work
        for data in target.seeds():
            (work / f"seed-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)
    argv = [
        sys.argv[0],
        f"-max_total_time={max(1, round(args.seconds))}",
        f"-runs={args.runs}",
        f"-timeout={args.input_timeout}",
        f"-rss_limit_mb={args.rss_limit_mb}",
        f"-artifact_prefix={findings}/",
        f"-seed={args.seed}",
        "-print_final_stats=1",
        "-max_len=65536",
        str(work),
        str(seeds),
    ]
    atheris.Setup(argv, _checked(target, not args.no_budget, findings))
    atheris.Fuzz()


def _start(target: Any, out: Path, args: argparse.Namespace) -> tuple[int, Path, float]:
    work = out / "corpus" / target.name
    findings = out / "findings" / target.name
    work.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    log = out / "logs" / f"{target.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            _child(target, work, findings, args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid, log, time.monotonic()


def _parse(outcome: Outcome, log: Path, out: Path) -> None:
    text = log.read_text(errors="replace")
    units = re.findall(r"stat::number_of_executed_units: (\d+)", text)
    done = re.findall(r"Done (\d+) runs in", text)
    outcome.inputs = int(units[-1]) if units else int(done[-1]) if done else 0
    outcome.corpus = len(list((out / "corpus" / outcome.target).iterdir()))
    outcome.findings = sorted(
        str(p.relative_to(out))
        for p in (out / "findings" / outcome.target).iterdir()
        if p.suffix != ".txt"
    )
    if outcome.exit != 0:
        tail = text.strip().splitlines()[-30:]
        outcome.error = "\n".join(tail)


def fuzz(targets: list[Any], out: Path, args: argparse.Namespace) -> list[Outcome]:
    """Every target in a child of its own, ``args.jobs`` at a time."""
    pending = list(targets)
    running: dict[int, tuple[Outcome, Path, float]] = {}
    done: list[Outcome] = []
    limit = args.seconds + 60 + args.input_timeout
    while pending or running:
        while pending and len(running) < args.jobs:
            t = pending.pop(0)
            pid, log, began = _start(t, out, args)
            running[pid] = (Outcome(t.name, args.seconds), log, began)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for cpid, (outcome, _, began) in list(running.items()):
                if time.monotonic() - began > limit:  # libFuzzer's own limits failed
                    os.kill(cpid, signal.SIGKILL)
                    outcome.error = f"did not end within {limit:.0f} s"
            time.sleep(0.2)  # sync-ok: children are reaped by polling waitpid
            continue
        if pid not in running:
            continue
        outcome, log, began = running.pop(pid)
        outcome.seconds = round(time.monotonic() - began, 1)
        outcome.exit = os.waitstatus_to_exitcode(status)
        _parse(outcome, log, out)
        done.append(outcome)
        mark = "ok" if outcome.exit == 0 and not outcome.findings else "FOUND"
        print(f"  {outcome.target:24s} {outcome.inputs:>9,} inputs  {mark}", flush=True)
    return sorted(done, key=lambda o: [t.name for t in targets].index(o.target))


def coverage(targets: list[Any], out: Path) -> dict[str, dict[str, Any]]:
    """Each target's line coverage of its code, from a fresh process (see ``_replay_all``)."""
    report = out / "coverage.json"
    names = ",".join(t.name for t in targets)
    cmd = [sys.executable, __file__, "--coverage-of", str(out), "--targets", names]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the coverage replay failed:\n{proc.stdout}\n{proc.stderr}")
    result: dict[str, dict[str, Any]] = json.loads(report.read_text())
    return result


def _replay_all(out: Path, names: list[str]) -> None:
    """In a fresh process, under coverage.py: every target's seeds built and its corpus (seeds
    and what the fuzzer added) replayed; writes ``OUT/coverage.json``."""
    import coverage as coverage_py

    # backends/ is transport/backends in the package (a link in the repository: coverage.py
    # names its files by the real path)
    cov = coverage_py.Coverage(data_file=None, include=["*/transport/*", "*/backends/*"])
    cov.start()
    targets = _import_targets(instrument=False)
    selected = targets.names(names)
    for t in selected:
        run = _checked(t, budget=False)
        t.seeds()
        for folder in (CORPUS / t.name, out / "corpus" / t.name):
            for path in sorted(folder.iterdir()) if folder.is_dir() else ():
                try:
                    run(path.read_bytes())
                except Exception as e:  # a finding: the fuzzing run names it
                    print(f"{t.name}: {path.name}: {type(e).__name__}: {e}", file=sys.stderr)
    cov.stop()
    result = {}
    for t in selected:
        lines, missing = 0, {}
        for path, span in targets.measured(t):
            _, statements, _, missed, _ = cov.analysis2(path)
            wanted = [n for n in statements if span is None or n in span]
            lines += len(wanted)
            gone = sorted(n for n in missed if n in wanted)
            if gone:
                missing[os.path.relpath(path, HERE.parent.parent)] = gone
        hit = lines - sum(len(v) for v in missing.values())
        result[t.name] = {
            "coverage": round(100 * hit / lines, 1) if lines else 100.0,
            "lines": lines,
            "missing": missing,
        }
    (out / "coverage.json").write_text(json.dumps(result, indent=1))


def write_seeds(targets: list[Any]) -> None:
    """The seed corpus rewritten from the encoders (regressions are kept)."""
    for t in targets:
        folder = CORPUS / t.name
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
        for data in t.seeds():
            (folder / f"seed-{hashlib.sha1(data).hexdigest()[:16]}").write_bytes(data)
        print(f"{t.name}: {len(list(folder.glob('seed-*')))} seeds")


def replay(targets: list[Any], path: Path) -> int:
    """One input through each selected target, its traceback printed."""
    data = path.read_bytes()
    status = 0
    for t in targets:
        try:
            _checked(t, budget=True)(data)
            print(f"{t.name}: handled")
        except Exception:
            traceback.print_exc()
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60, help="per target (default 60)")
    p.add_argument(
        "--runs",
        type=int,
        default=-1,
        help="per target, stop after this many inputs (the corpus's included) if that comes "
        "before --seconds (default: no bound): a run whose work does not depend on the load",
    )
    p.add_argument("--targets", help="comma-separated names (default: every target)")
    p.add_argument("--jobs", type=int, default=1, help="targets fuzzed at once (default 1)")
    p.add_argument(
        "--out", type=Path, help="where corpora, findings and logs go (default: a temp dir)"
    )
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed")
    p.add_argument("--input-timeout", type=int, default=10, help="seconds one input may take")
    p.add_argument("--rss-limit-mb", type=int, default=4096)
    p.add_argument("--no-budget", action="store_true", help="skip the allocation check (faster)")
    p.add_argument("--no-coverage", action="store_true")
    p.add_argument("--write-seeds", action="store_true")
    p.add_argument("--replay", type=Path, help="one input through the selected targets")
    p.add_argument("--coverage-of", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    selected = args.targets.split(",") if args.targets else None
    if args.coverage_of:
        _replay_all(args.coverage_of, selected or [])
        return 0
    mod = _import_targets(not (args.write_seeds or args.replay), selected)
    targets = mod.names(selected)
    if args.write_seeds:
        write_seeds(targets)
        return 0
    if args.replay:
        return replay(targets, args.replay)
    out = args.out or Path(tempfile.mkdtemp(prefix="fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"fuzzing {len(targets)} targets, {args.seconds:.0f} s each, into {out}", flush=True)
    outcomes = fuzz(targets, out, args)
    if not args.no_coverage:
        for name, c in coverage(targets, out).items():
            o = next(o for o in outcomes if o.target == name)
            o.coverage, o.lines, o.missing = c["coverage"], c["lines"], c["missing"]
    failed = [o for o in outcomes if o.findings or o.exit != 0 or o.error]
    total = sum(o.inputs for o in outcomes)
    print(f"{'target':24s} {'inputs':>10s} {'coverage':>9s}  findings")
    for o in outcomes:
        cov = "" if o.coverage is None else f"{o.coverage:.1f}%"
        print(f"{o.target:24s} {o.inputs:>10,} {cov:>9s}  {', '.join(o.findings) or '-'}")
    print(f"{total:,} inputs in all; {len(failed)} targets with findings or errors")
    for o in failed:
        print(f"--- {o.target} (exit {o.exit}) ---\n{o.error}")
    if args.json:
        report = {
            "seconds": args.seconds,
            "inputs": total,
            "targets": [asdict(o) for o in outcomes],
        }
        args.json.write_text(json.dumps(report, indent=1))
    if not args.out:
        keep = any(o.findings for o in outcomes)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
