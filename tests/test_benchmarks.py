"""Every benchmark script runs from a fresh clone at its smallest settings, so that a broken
baseline fails here instead of a user's run, and what each reports is checked: the bytes it
moved were verified, the versions it checked were whole, each worker took exactly the bytes it
was written. Elsewhere: verl_update (Ray clusters, one at a time: test_benchmarks_servers.py),
trl_sync (the TRL tests run their job through it). The GPU scripts run in the GPU check
(benchmarks/gpu_check.sh) instead."""

from __future__ import annotations

import importlib.util
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


def test_idle_reports_every_role(tmp_path: Path):
    out = tmp_path / "idle.json"
    run("idle.py", "--seconds", "1", "--json", str(out))
    results = {r["role"]: r for r in load(out)["results"]}
    assert set(results) == {"endpoint", "subscriber", "relay", "leaf"}, results
    for r in results.values():
        assert 0 <= r["core_share"] < 1 and r["engine_wakeups_per_s"] >= 0, r
        assert any(n.startswith("transport-engine") for n in r["switches_per_s"]), r


def test_version_timeline_counts_each_versions_messages(tmp_path: Path):
    out = tmp_path / "timeline.json"
    run(
        "version_timeline.py",
        "--params",
        "64K",
        "--tensors",
        "16",
        "--versions",
        "3",
        "--json",
        str(out),
    )
    report = load(out)
    assert report["whole"] is True, report
    msgs = report["messages_per_version"]
    assert msgs["subscriber took Begin"] == 2 and msgs["subscriber took Ver"] == 2, msgs
    phases = report["median_us"]
    assert 0 < phases["posted"] <= phases["written"] <= phases["published"], phases


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


def _need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TRANSPORT_TEST_VLLM") == "1":
            pytest.fail("vLLM is not installed, and the test command promised it", pytrace=False)
        pytest.skip("vLLM is not installed (tests/run.sh installs its CPU build)")


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_update_runs_every_mode_and_each_worker_takes_what_it_was_written(tmp_path: Path):
    """One vLLM server (TP = 1), every mode and its baselines (shm, the loader's floor): each
    worker's engine says it took a version of exactly the bytes the trainer counted writing to
    it, the same in each mode at TP = 1: the whole model."""
    _need_vllm()
    out = tmp_path / "vllm.json"
    run(
        "vllm_update.py",
        *("--tp", "1", "--hidden", "64", "--layers", "1", "--vocab", "256"),
        *("--rounds", "1", "--blocks", "1", "--json", str(out)),
        timeout=540,
    )
    doc = load(out)
    model = round(doc["model"]["mib"] * (1 << 20))
    modes = doc["tp"]["1"]["modes"]
    assert set(modes) == {"whole", "sharded", "streamed"}, list(modes)
    for mode, got in modes.items():
        (worker,) = got["workers"]
        # whole: every tensor goes through vLLM's loader, as asked; the others load directly
        assert (worker["fallback"] == {}) == (mode != "whole"), (mode, worker)
        assert worker["written_per_version"] == [worker["version_bytes"]], (mode, worker)
        assert got["time_stats_s"]["shm"]["median"] > 0  # the baseline ran beside it
    # at TP = 1 each mode moves the whole model (its size is reported to a tenth of a MiB)
    sizes = {m["workers"][0]["version_bytes"] for m in modes.values()}
    assert len(sizes) == 1 and abs(sizes.pop() - model) <= 0.05 * (1 << 20), (sizes, model)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_lora_update_moves_the_adapter_only_beside_the_file_round_trip(tmp_path: Path):
    """One vLLM server with LoRA: ours moves exactly the adapter's bytes into vLLM's slots, and
    the file round trip runs beside it. TRL's merged way is left out here: on a server with
    LoRA its worker grows by about 30 times the model's bytes while the merged trainer's engine
    joins (a finding of its own), more than this machine has beside the rest of the suite. The
    vocabulary is cut to 1,024 (the embedding is no target: the adapter's bytes are the same),
    so the server loads 60 MiB instead of 580."""
    _need_vllm()
    out = tmp_path / "lora.json"
    run(
        "lora_update.py",
        *("--layers", "1", "--vocab", "1024", "--ranks", "8", "--rounds", "1"),
        *("--merged-rounds", "0"),
        *("--json", str(out)),
        timeout=540,
    )
    doc = load(out)
    r8 = doc["r8"]
    assert r8["sent_mib"] == r8["adapter_mib"] > 0, r8
    assert r8["transport_s"] > 0 and r8["file_s"] > 0 and r8["request_s"] > 0, r8
    assert "merged" not in doc


@pytest.mark.timeout(600)
def test_faults_soak_kills_and_freezes_subscribers_and_every_version_checked_is_whole(
    tmp_path: Path,
):
    """The soak's shortest run with faults (its seed 1: a subscriber killed and restarted at
    about 3.5 s, another frozen after it), on the embedded store, with versions of 2 MiB (8
    tensors of 256 KiB: a version's size changes nothing checked here): every version a subscriber
    applied is checked element by element against what it must hold, none is wrong, and every
    subscriber, the restarted one too, holds a version published after the last fault (the run
    publishes past its duration until they do: a restart on a loaded machine takes long)."""
    out = tmp_path / "soak.json"
    run(
        "faults_soak.py",
        *("--store", "embedded", "--seed", "1", "--warmup", "1", "--duration", "24"),
        *("--calm", "8", "--converge-by", "300", "--numel", str(1 << 16)),
        *("--json", str(out)),
        timeout=540,
    )
    rep = load(out)
    assert rep["faults"].get("kill", 0) >= 1, rep["faults"]
    assert rep["bad"] == 0 and rep["checked"] > 0, rep
    assert rep["convergence_s"] != "never", rep["subscribers"]
    restarted = [s for s in rep["subscribers"].values() if s["incarnations"] > 1]
    assert restarted and all(s["bad"] == 0 and s["checks"] > 0 for s in restarted), rep
