"""The decoders under coverage-guided fuzzing (run.py, atheris): every target RUNS inputs from
its corpus (a count, not a time: a loaded machine does the same work), every file of the corpus
(seeds, and the inputs of findings fixed since) replayed, and the runner proved to report what
it must (a planted error, an allocation past the budget, a hang). The long run and its figures: ``python tests/fuzz/run.py --seconds 600 --jobs 2``
(benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

pytest.importorskip("atheris", reason="atheris has wheels for CPython 3.11 and 3.12 on Linux")

HERE = Path(__file__).resolve().parent
RUN = HERE / "run.py"
#: inputs per target in the test command, the corpus's included (the long run is the runner's
#: own): a count, not a time, so that a loaded machine runs the same work, only slower
RUNS = int(os.environ.get("TRANSPORT_FUZZ_RUNS", "300"))
#: the bound on each target's time, far past what RUNS takes (a few seconds on a loaded machine)
SECONDS = 120

sys.path.insert(0, str(HERE))
import fuzz_targets  # noqa: E402


def _runner(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUN), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )


@pytest.mark.parametrize("target", fuzz_targets.TARGETS, ids=lambda t: t.name)
def test_every_file_of_the_corpus_is_handled_and_some_seed_is_accepted(target):
    folder = HERE / "corpus" / target.name
    files = sorted(folder.iterdir())
    assert any(f.name.startswith("seed-") for f in files), f"no seed corpus in {folder}"
    accepted = 0
    for f in files:
        try:
            target.run(f.read_bytes())
            accepted += 1
        except target.allowed:
            assert f.name.startswith(("seed-", "regression-")), f.name
    assert accepted, f"no file of {folder} decodes: the seeds are stale (run.py --write-seeds)"


@pytest.mark.timeout(600)
def test_each_target_fuzzes_from_its_corpus_and_finds_nothing(tmp_path):
    report = tmp_path / "report.json"
    proc = _runner(
        "--runs",
        str(RUNS),
        "--seconds",
        str(SECONDS),
        "--out",
        str(tmp_path / "out"),
        "--json",
        str(report),
        "--no-coverage",
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    got = {t["target"]: t for t in json.loads(report.read_text())["targets"]}
    assert set(got) == {t.name for t in fuzz_targets.TARGETS}
    for name, t in got.items():
        assert t["inputs"] >= RUNS, f"{name} ran {t['inputs']} inputs of {RUNS}"
        assert not t["findings"], (name, t["findings"])
    print(f"\nfuzz: {sum(t['inputs'] for t in got.values()):,} inputs in {len(got)} targets")


@pytest.mark.timeout(300)
def test_the_runner_reports_an_error_an_allocation_past_the_budget_and_a_hang(tmp_path):
    report = tmp_path / "report.json"
    names = "selftest_error,selftest_budget,selftest_hang"
    proc = _runner(
        "--targets",
        names,
        "--seconds",
        "60",
        "--input-timeout",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--json",
        str(report),
        "--no-coverage",
        timeout=280,
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    got = {t["target"]: t for t in json.loads(report.read_text())["targets"]}
    for name, kind in (
        ("selftest_error", "crash-"),
        ("selftest_budget", "crash-"),
        ("selftest_hang", "timeout-"),
    ):
        (finding,) = got[name]["findings"]
        assert Path(finding).name.startswith(kind), (name, finding)
    error = tmp_path / "out" / got["selftest_error"]["findings"][0]
    budget = tmp_path / "out" / got["selftest_budget"]["findings"][0]
    assert 'KeyError: "a decoder\'s bug"' in Path(f"{error}.txt").read_text()
    assert "the budget is" in Path(f"{budget}.txt").read_text()
    # a finding's input replays into the same error
    again = _runner("--replay", str(error), "--targets", "selftest_error", timeout=120)
    assert again.returncode == 1 and "a decoder's bug" in again.stderr, again.stderr[-2000:]
