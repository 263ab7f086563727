"""``transport chaos``: a weight-sync job across the hosts of a cluster (transport/cluster/) under
a seeded schedule of faults, its invariants checked all the time (run.py, invariants.py).

It is a subcommand, not a benchmark script, so that whoever installs the library can prove it
on their own machine with the command the project proves it with (root and iproute2, as for
``transport cluster``); the same seed, or ``--replay EVENTS``, runs the same schedule again.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from transport.cli.chaos.run import Config, Run, print_outcome
from transport.cli.chaos.schedule import HOLDS, from_log, kinds_for, plan


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="a weight-sync job across namespaced hosts under seeded faults, invariants checked",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    p.add_argument("--duration", type=float, default=60, help="seconds of faults (default 60)")
    p.add_argument("--warmup", type=float, default=5, help="seconds before the first fault")
    p.add_argument("--generators", type=int, default=4, help="generator hosts (default 4)")
    p.add_argument("--store", choices=("tcp", "redis"), default="redis")
    p.add_argument("--kinds", help=f"comma-separated fault kinds (default: all of {list(HOLDS)})")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--numel", type=int, default=1 << 18, help="float32 elements per tensor")
    p.add_argument("--fanout", default="tree", choices=("direct", "chain", "tree"))
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--no-delta", action="store_true", help="start with delta updates off")
    p.add_argument("--deadline", type=float, default=10.0, help="each publish's deadline")
    p.add_argument("--converge-by", type=float, default=60.0, help="the bound after the faults")
    p.add_argument("--note-bound", type=float, default=10.0, help="a notification's bound")
    p.add_argument("--rss-ceiling-mb", type=int, default=3072)
    p.add_argument("--rate", default="1gbit", help="every link's rate (default 1gbit)")
    p.add_argument("--pace", type=float, default=0.2, help="the trainer's pause between versions")
    p.add_argument(
        "--plant",
        default="",
        help="plant a fault in the job that the run must catch (corrupt:gen0: a generator flips "
        "a bit of what it applied): proves the run can fail",
    )
    p.add_argument("--replay", type=Path, help="run the schedule (and settings) of an event log")
    p.add_argument(
        "--until",
        type=float,
        help="with --replay: only the faults that begin before this many seconds",
    )
    p.add_argument("--out", type=Path, help="the run's folder (default: a new temporary one)")
    p.add_argument("--json", type=Path, help="write the outcome here too")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.replay:
        header, schedule = from_log(args.replay)
        fields = {k: header[k] for k in Config.__dataclass_fields__ if k in header}
        config = Config(**fields)
        if args.until is not None:
            schedule = [f for f in schedule if f.at + f.hold <= args.until]
            config.duration = args.until
    else:
        kinds = kinds_for(args.store, args.kinds.split(",") if args.kinds else None)
        if args.generators < 1:
            raise ValueError("a chaos run needs at least one generator")
        config = Config(
            seed=args.seed,
            duration=args.duration,
            warmup=args.warmup,
            generators=args.generators,
            store=args.store,
            kinds=kinds,
            tensors=args.tensors,
            numel=args.numel,
            fanout=args.fanout,
            degree=args.degree,
            delta=not args.no_delta,
            deadline=args.deadline,
            converge_by=args.converge_by,
            note_bound=args.note_bound,
            rss_ceiling_mb=args.rss_ceiling_mb,
            rate=args.rate,
            pace=args.pace,
            plant=args.plant,
        )
        schedule = plan(config.seed, 0.0, config.duration, kinds, config.generators)
    folder = args.out or Path(tempfile.mkdtemp(prefix="transport-chaos-"))
    outcome = Run(config, schedule, folder).execute()
    print_outcome(outcome)
    if args.json:
        args.json.write_text(json.dumps(vars(outcome), indent=1))
    return 1 if outcome.violations else 0
