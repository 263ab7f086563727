"""TRL's AsyncGRPOTrainer (from the registry) trains against a real vLLM server (the CPU build)
and syncs after every optimizer step through transport: one job (tests/helpers/trl_job.py: a
LoRA run, a full run whose server is killed before its last sync, and the server restarted),
and each test checks one claim of its report. The job takes minutes: it runs once per session,
through its benchmark (benchmarks/trl_sync.py, which adds the file round trips it compares
with), so that the benchmark runs in the test command too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from helpers.processes import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.trl, pytest.mark.lora, pytest.mark.timeout(1200)]

STEPS = 10
#: the LoRA run's steps: each moves the adapter (its learning rate is high) far enough that
#: vLLM's log-probabilities move with it, which the test checks; its reward is not checked (the
#: full run's steps are the ones whose reward must rise)
LORA_STEPS = 4
#: vLLM's log-probability of a token against transformers' on the same weights (both float32
#: on the CPU; the job's own TOLERANCE for the full run's samples)
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # found, not imported: importing vLLM and peft costs seconds of CPU each, and the job
    # imports them anyway (a broken install fails it)
    for module in ("vllm", "trl", "peft"):
        if importlib.util.find_spec(module) is None:
            if os.environ.get("TRANSPORT_TEST_VLLM") == "1":
                pytest.fail(f"{module} is not installed (examples/setup_vllm.sh installs it)")
            pytest.skip(f"{module} is not installed (examples/setup_vllm.sh installs it)")
    work = tmp_path_factory.mktemp("trl")
    out, summary = work / "report.json", work / "summary.json"
    bench = [sys.executable, str(REPO / "benchmarks/trl_sync.py"), "--work", str(work)]
    proc = subprocess.run(
        [*bench, "--out", str(summary), "--steps", str(STEPS), "--lora-steps", str(LORA_STEPS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-6000:]
    report = dict(json.loads(out.read_text()))
    report["summary"] = json.loads(summary.read_text())
    return report


def rose(rewards: list[float]) -> bool:
    """The mean reward of the last three steps is at least three times that of the first two
    (a random policy scores about 1/16; the runs reach well over 0.3)."""
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    return last >= 3 * first and last > 0.15


def test_lora_run_syncs_only_the_adapter_and_vllm_serves_it_under_the_models_name(report):
    lora = report["lora"]
    assert lora["error"] is None, lora["error"]
    assert [s["version"] for s in lora["syncs"]] == list(range(1, LORA_STEPS + 2))
    assert len(lora["checks"]) == LORA_STEPS
    for check in lora["checks"]:
        # requests name the model (as TRL's rollouts do) and are served by the newest adapter
        assert check["equal"], check
        (adapter,) = check["adapters"].values()
        assert adapter["version"] == check["version"]
        # each version moved the adapter's bytes and nothing of the base model
        assert adapter["version_bytes"] == lora["adapter_bytes"]
        assert check["model_version"] == -1  # the base weights vLLM started with
        # and the log-probabilities of those tokens (greedy tokens alone may not move)
        assert check["logprob_err"] <= LOGPROB_TOLERANCE, check
    final = lora["final"]
    assert final["equal"] and final["logprob_err"] <= LOGPROB_TOLERANCE, final
    # the adapter changed what is served: the base model's log-probabilities (which a server
    # still on the first version, a zero B, serves) are far from the last adapter's
    assert final["base_gap"] > 10 * LOGPROB_TOLERANCE, final
    assert lora["adapter_bytes"] * 10 < lora["model_bytes"]


def test_full_run_vllm_holds_the_trainers_weights_after_every_sync(report):
    full = report["full"]
    assert len(full["checks"]) == STEPS + 1
    for check in full["checks"]:
        assert check["equal"], check
        assert check["served"] == str(check["version"])  # vLLM reports the version it loaded


def test_full_run_reward_rises(report):
    assert rose(report["full"]["rewards"][:STEPS]), report["full"]["rewards"]


def test_full_run_every_sample_comes_whole_from_one_version_no_older_than_its_tag(report):
    # the job pauses with mode "wait": a request running when a version starts to load
    # finishes on the version it started with, so no sample mixes two; TRL tags a group of
    # completions with the version of its first request, so a group that a sync splits has
    # later members from the next version (tagged one older: TRL's staleness errs long).
    # A torn sample matches no version. A short, near-certain completion can match two
    # versions within the tolerance, so the version that explains it best is judged against
    # its tag, and most samples must match their tag's version alone.
    samples = report["full"]["samples"]
    assert len(samples) >= 100
    for s in samples:
        assert s["matches"], s
        least = min(s["closest"].values())
        best = [int(v) for v, diff in s["closest"].items() if diff == least]
        assert max(best) >= s["tag"], s
    assert sum(s["matches"] == [s["tag"]] for s in samples) * 2 > len(samples)


def test_every_sync_pauses_vllm_only_to_load_and_resumes_it(report):
    calls = report["full"]["calls"]
    load = [
        "init_weight_transfer_engine",
        "pause",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "resume",
    ]
    # the first sync's trainer joins the server's workers, then every sync that reached the
    # server: joined (a no-op for workers that listen), published, paused only to load
    assert calls[0] == "init_weight_transfer_engine", calls
    assert calls[1:] == load * (STEPS + 1), calls


def test_a_killed_server_fails_the_sync_with_an_error_naming_it(report):
    full = report["full"]
    error = full["error"]
    assert error is not None and error.startswith("SyncError: "), error
    assert f"version {STEPS + 2} to the vLLM server at http://" in error, error
    # no hang: the error came within the transfer's deadline (60 s) and its HTTP round trips
    assert full["error_after_kill_s"] < 60 + 90, full


def test_a_restarted_server_takes_the_next_sync_whole(report):
    restart = report["restart"]
    assert restart["got"] == restart["want"], restart
    assert restart["before"] != restart["want"]  # it started on the checkpoint's weights
    assert restart["served"] == str(restart["version"])


def test_the_benchmark_compares_each_sync_with_vllms_file_round_trip(report):
    """benchmarks/trl_sync.py's figures of the same run: each sync's share of a step, and the
    file round trips (peft's save and vLLM's adapter load; safetensors and reload_weights) in
    the same run, timed as often as ours."""
    summary, restart = report["summary"], report["restart"]
    for phase in ("full", "lora"):
        assert summary[phase]["sync_share_of_step"] > 0, summary[phase]
        assert summary[phase]["file_median_s"] > 0, summary[phase]
    assert len(report["lora"]["file_s"]) == len(restart["file_s"]) == 3
    assert len(restart["transport_s"]) == 3
