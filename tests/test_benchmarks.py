"""Every benchmark script runs from a fresh clone at its smallest settings, so that a broken
baseline fails here instead of a user's run, and what each reports is checked: the bytes it
moved were verified, the versions it checked were whole. The scripts that start vLLM servers or
TRL's trainer (vllm_update, lora_update, trl_sync, verl_update), the fault soak (whose shortest
run with faults takes minutes) and the GPU scripts are not here yet: see benchmarks/README.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run(script: str, *args: str, timeout: float = 240) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (script, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def load(path: Path) -> Any:
    return json.loads(path.read_text())


def test_bench_core_verifies_every_record(tmp_path: Path):
    out = tmp_path / "core.json"
    run(
        "bench_core.py",
        "--quick",
        "--max-size",
        "64K",
        "--systems",
        "memcpy,raw",
        "--json",
        str(out),
    )
    records = load(out)["records"]
    assert {r["system"] for r in records} >= {"ours", "raw-nixl"}, records
    assert all(r["verified"] for r in records), records
    assert any(r["system"] == "ours" and r.get("verified") for r in records)


def test_delta_step_reports_each_rate():
    out = run("delta_step.py", "--steps", "1", "--lrs", "1e-5", "--hidden", "64", "--layers", "1")
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("1e-05")]
    assert len(rows) == 1, out
    changed = float(rows[0][2].rstrip("%"))
    assert 0 < changed < 100, rows  # a step changes some elements, never all of them


def test_fanout_measures_every_shape_at_each_count(tmp_path: Path):
    out = tmp_path / "fanout.json"
    run(
        "fanout.py",
        "--generators",
        "1,2",
        "--params",
        "1M",
        "--tensors",
        "8",
        "--steps",
        "2",
        "--json",
        str(out),
    )
    runs = load(out)
    assert set(runs) == {"1", "2"}, list(runs)
    for count, report in runs.items():
        assert report["records"], count
        assert all(r["verified"] for r in report["records"]), report["records"]
