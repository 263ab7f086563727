"""``transport chaos`` in the test command: a short seeded run with every kind of fault its store
allows, overlapping, across the hosts of a cluster (trainer, four generators behind a relay
tree, Redis on its own host), its invariants checked all along; the same schedule replayed from
its event log; and a planted corruption that the run must catch, ending it with the log and
every process's flight-recorder dump. Longer runs and their figures: benchmarks/README.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from transport.cli.chaos.schedule import kinds_for, plan

pytestmark = [pytest.mark.hosts, pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(900)]


def chaos(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transport.cli", "chaos", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def faults(folder: Path, phase: str = "begin") -> list[tuple]:
    """The faults an event log says were applied: (seq, at, kind, target, hold, amount)."""
    out = []
    for line in (folder / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "fault" and e["phase"] == phase:
            out.append((e["seq"], e["at"], e["kind"], e["target"], e["hold"], e["amount"]))
    return out


def test_a_seeded_run_converges_under_every_kind_of_fault_and_its_replay_runs_the_same(
    rights, tmp_path
):
    first = tmp_path / "first"
    seed, kinds = "82", kinds_for("redis")  # 21 faults in 20 s, every kind (Redis store)
    assert {f.kind for f in plan(int(seed), 0.0, 20.0, kinds, 4)} == set(kinds)
    done = chaos("--seed", seed, "--duration", "20", "--out", str(first), "--json", f"{first}.json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    o = json.loads(Path(f"{first}.json").read_text())
    print(f"\nchaos, seed {seed}: {json.dumps(o)}")
    assert o["violations"] == []
    assert len(o["faults"]) >= 6, o["faults"]  # several kinds, overlapping
    assert sorted(faults(first, "begin")) == sorted(faults(first, "end"))  # each was undone
    # versions went through, every byte of each checked against the trainer's digest
    assert o["published"] >= 10 and o["verified"] >= 2 * o["published"], o
    assert o["notes"] > 0, o  # notifications of completed puts arrived
    assert o["converged_s"] is not None

    again = tmp_path / "again"
    # its first 10 s again, from the log: the same faults at the same times
    done = chaos("--replay", str(first / "events.jsonl"), "--until", "10", "--out", str(again))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replayed = faults(again)
    assert replayed and replayed == [f for f in faults(first) if f[1] + f[4] <= 10]


def test_a_planted_corruption_stops_the_run_with_its_log_and_every_dump(rights, tmp_path):
    done = chaos(
        "--seed",
        "3",
        "--duration",
        "30",
        "--kinds",
        "stop,loss",
        "--plant",
        "corrupt:gen1",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (violation,) = [e for e in events if e["event"] == "violation"][:1]
    assert "gen1" in violation["what"] and "1 wrong elements" in violation["what"], violation
    # it stopped there: no calm, no convergence; every live process dumped its flight recorder
    assert not [e for e in events if e["event"] in ("calm", "converged")]
    dumped = {p.parent.name for p in (tmp_path / "traces").rglob("*") if p.is_file()}
    assert {"trainer", "gen0", "gen1", "gen2", "gen3"} <= dumped, dumped
