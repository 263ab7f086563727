"""The benchmark scripts that start Ray clusters or vLLM servers run here at their smallest
settings (the other scripts: test_benchmarks.py), in the test command's lane of such files
(tests/helpers/scheduling.py: one server at a time), so that a broken baseline fails here
instead of in a user's run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.vllm, pytest.mark.verl, pytest.mark.slow, pytest.mark.timeout(600)]


def test_verl_update_runs_both_engines_and_every_worker_holds_the_checkpoint(
    tmp_path: Path,
):
    """verl's nixl engine (the baseline that broke at its warm-up) and ours into 2 rollout
    workers; each worker's weights of the last update are compared with the checkpoint, every
    tensor (verl's own checker). Ours with ``delta`` runs in the same harness in
    tests/integrations/verl/test_verl.py (every engine there keeps copies), so it is left out
    here: each engine of a run starts four Ray actors of its own, each importing verl and vLLM."""
    pytest.importorskip("verl", reason="verl is not installed: bash examples/setup_verl.sh")
    out = tmp_path / "verl.json"
    cmd = [sys.executable, "benchmarks/verl_update.py", "--hidden", "64", "--layers", "1"]
    cmd += ["--vocab", "1024", "--bucket-mb", "1", "--updates", "2", "--workers", "2"]
    cmd += ["--engines", "nixl,transport", "--check", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["workers"], r["checked"]) for r in rows] == [
        ("nixl", 2, True),
        ("transport", 2, True),
    ]
    assert all(len(r["update_s_all"]) == 2 for r in rows)
    assert "x2: ours" in done.stdout and "faster than verl's nixl" in done.stdout


def test_vllm_idle_measures_a_server_with_its_subscribers_idle_and_with_the_engine_torn_down(
    tmp_path: Path,
):
    """One round of each condition on one vLLM server at the smallest settings: every request
    generated the tokens it asked for, the idle workers held the version and our threads, and
    the torn-down ones none of them (the script checks both through transport_state)."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bash examples/setup_vllm.sh")
    out = tmp_path / "idle.json"
    cmd = [sys.executable, "benchmarks/vllm_idle.py", "--rounds", "1", "--requests", "1"]
    cmd += ["--tokens", "8", "--batch", "2", "--hidden", "64", "--layers", "1", "--vocab", "256"]
    cmd += ["--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    rounds = json.loads(out.read_text())["rounds"]
    assert sorted(r["condition"] for r in rounds) == ["idle", "without"]
    for r in rounds:
        assert r["tokens"] == 2 * 8, r
        ours = r["wakeups"]["our_threads"]
        assert ours > 0 if r["condition"] == "idle" else ours == 0, r
