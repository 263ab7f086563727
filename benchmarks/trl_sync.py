"""TRL's AsyncGRPOTrainer syncing through transport: what a sync costs in a real run.

    .venv/bin/python benchmarks/trl_sync.py [--steps 10] [--out benchmarks/results-trl.json]

Runs the TRL tests' job (tests/helpers/trl_job.py --baseline: a LoRA run and a full run of
``steps`` optimizer steps (``--lora-steps``: the LoRA run's, if fewer) against one vLLM
server of the CPU build, the server killed before
the full run's last sync and restarted) and reports, from that one run:

* the sync as a share of the optimizer step (median sync seconds over median step seconds,
  TRL's own ``perf/step_s``), full model and adapter;
* each against vLLM's own file round trip in the same run: the model saved in safetensors and
  reloaded with ``reload_weights``, the adapter saved by peft and loaded with
  ``/v1/load_lora_adapter``, each until a request is served (our full syncs here also end with
  one request; the adapter's in-run syncs do not, so that ratio leans against us);
* the trainer's and the server's memory (RSS) before the first step and before the last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def summary(report: dict) -> dict:
    out: dict = {}
    for phase in ("full", "lora"):
        run = report[phase]
        syncs = [s["seconds"] for s in run["syncs"]]
        step = statistics.median(run["step_s"])
        first, last = run["memory"][0], run["memory"][-1]
        out[phase] = {
            "sync_median_s": statistics.median(syncs),
            "step_median_s": step,
            "sync_share_of_step": statistics.median(syncs) / step,
            "trainer_rss_growth_mib": (last["trainer"] - first["trainer"]) / MIB,
            "server_rss_growth_mib": (last["server"] - first["server"]) / MIB,
            "rewards": run["rewards"],
        }
    lora, restart = report["lora"], report["restart"]
    out["lora"]["file_median_s"] = statistics.median(lora["file_s"])
    out["lora"]["file_over_transport"] = out["lora"]["file_median_s"] / out["lora"]["sync_median_s"]
    out["full"]["transport_with_request_median_s"] = statistics.median(restart["transport_s"])
    out["full"]["file_median_s"] = statistics.median(restart["file_s"])
    out["full"]["file_over_transport"] = (
        out["full"]["file_median_s"] / out["full"]["transport_with_request_median_s"]
    )
    out["adapter_bytes"], out["model_bytes"] = lora["adapter_bytes"], lora["model_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--lora-steps", type=int, default=None, help="the LoRA run's steps (default: --steps)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results-trl.json")
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="the job's folder (its model, server log and report.json); default: a new one",
    )
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="trl-bench-"))
    report_path = work / "report.json"
    job = HERE.parent / "tests" / "helpers" / "trl_job.py"
    cmd = [sys.executable, str(job), "--work", str(work), "--report", str(report_path)]
    cmd += ["--steps", str(args.steps), "--baseline"]
    if args.lora_steps is not None:
        cmd += ["--lora-steps", str(args.lora_steps)]
    subprocess.run(cmd, check=True)
    result = summary(json.loads(report_path.read_text()))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for phase in ("full", "lora"):
        r = result[phase]
        print(
            f"{phase}: sync {r['sync_median_s'] * 1e3:.0f} ms = {r['sync_share_of_step']:.1%} of "
            f"a {r['step_median_s']:.2f} s step; file round trip {r['file_median_s'] * 1e3:.0f} ms "
            f"({r['file_over_transport']:.2f}x ours); RSS growth trainer "
            f"{r['trainer_rss_growth_mib']:+.0f} MiB, server {r['server_rss_growth_mib']:+.0f} MiB"
        )


if __name__ == "__main__":
    main()
