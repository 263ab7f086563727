"""Direct against relayed fan-out at 1, 2 and 4 generators: one ``transport bench sync`` run per
generator count (direct, chain and tree interleaved step by step in each, raw NIXL as the
baseline), then one table and one plot.

    python benchmarks/fanout.py                        # 1 GiB in 300 tensors, 1/2/4 generators
    python benchmarks/fanout.py --generators 2,4 --params 64M --plot /tmp/fanout.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SYSTEMS = ["raw-nixl", "ours", "ours-chain", "ours-tree"]
LABELS = {
    "raw-nixl": "raw NIXL (direct)",
    "ours": "direct",
    "ours-chain": "chain",
    "ours-tree": "tree",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generators", default="1,2,4", help="comma list (default 1,2,4)")
    ap.add_argument("--params", default="256M", help="as for transport bench sync (default 256M)")
    ap.add_argument("--tensors", default="300")
    ap.add_argument("--steps", default="10")
    ap.add_argument("--degree", default="2")
    ap.add_argument("--json", default=None, help="write every run's records here")
    ap.add_argument("--plot", default=None, help="PNG of time per sync against generators")
    args = ap.parse_args()
    counts = [int(x) for x in args.generators.split(",") if x.strip()]
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            out = Path(tmp) / f"g{n}.json"
            cmd = [
                sys.executable,
                "-m",
                "transport.cli",
                "bench",
                "sync",
                "--generators",
                str(n),
                "--fanout",
                "direct,chain,tree",
                "--degree",
                args.degree,
                "--baselines",
                "raw",
                "--params",
                args.params,
                "--tensors",
                args.tensors,
                "--steps",
                args.steps,
                "--json",
                str(out),
                "--no-progress",
            ]
            print(f"$ transport {' '.join(cmd[3:])}", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            runs[n] = json.loads(out.read_text())
    print()
    print(
        f"{'generators':>10}  "
        + "".join(f"{LABELS[s]:>20}" for s in SYSTEMS)
        + f"  {'chain/direct':>13} {'tree/direct':>12}"
    )
    for n, doc in runs.items():
        rec = {r["system"]: r for r in doc["records"]}
        cells = "".join(f"{rec[s]['median_s'] * 1e3:>17.1f} ms" for s in SYSTEMS)
        paired = {x["name"]: x.get("paired") for x in doc["ratios"]}
        print(
            f"{n:>10}  {cells}  {rec['ours-chain']['median_s'] / rec['ours']['median_s']:>6.3f} "
            f"[{paired.get('ours-chain/ours time') or 0:.3f}] "
            f"{rec['ours-tree']['median_s'] / rec['ours']['median_s']:>5.3f} "
            f"[{paired.get('ours-tree/ours time') or 0:.3f}]"
        )
    print("\n(median time per sync to every generator; [paired step by step])")
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): d for n, d in runs.items()}, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for s in SYSTEMS:
            ys = [{r["system"]: r for r in runs[n]["records"]}[s]["median_s"] for n in counts]
            ax.plot(
                counts, ys, marker="o", label=LABELS[s], linestyle="--" if s == "raw-nixl" else "-"
            )
        ax.set_xticks(counts)
        ax.set_xlabel("generators")
        ax.set_ylabel("time per weight sync (s, median)")
        first = next(iter(runs.values()))["records"][0]
        ax.set_title(
            f"fan-out of {first['bytes'] / 2**30:.2f} GiB in {first['tensors']} tensors", fontsize=9
        )
        ax.set_ylim(0, None)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
