"""``transport trace DIR``: the flight-recorder dumps of every peer, merged into one timeline, with
the transfers that never completed and the peers that went silent."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from transport import trace


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "trace", help="merge flight-recorder dumps into one timeline", description=__doc__
    )
    p.add_argument("dir", help="the directory the Transports dumped into (trace_dir=)")
    p.add_argument("--last", type=int, default=40, help="timeline events to print (default 40)")
    p.add_argument("--json", action="store_true", help="print the whole analysis as JSON")
    p.set_defaults(run=run)


def _at(t_ns: int) -> str:
    return datetime.datetime.fromtimestamp(t_ns / 1e9).strftime("%H:%M:%S.%f")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    from transport import CliError

    d = Path(args.dir)
    if not d.is_dir():
        raise CliError(f"{d} is not a directory; give the trace_dir the Transports dumped into")
    if args.last < 0:
        raise CliError(f"--last must be at least 0, got {args.last}")
    dumps = trace.load(d.glob("*.jsonl"))
    if not dumps:
        raise CliError(
            f"no flight-recorder dumps in {d} (files *.jsonl written by Transport.dump_trace, "
            "on errors with trace_dir= or $TRANSPORT_TRACE_DIR set, or on SIGUSR1)"
        )
    a = trace.analyze(dumps)
    if args.json:
        print(json.dumps(a, indent=1))
        return 0
    print(
        f"{len(dumps)} dumps from {len({(h['name'], h['generation']) for h in a['dumps']})} "
        f"Transports; {len(a['timeline'])} events"
    )
    for h in sorted(a["dumps"], key=lambda h: h["dumped_at"]):
        print(
            f"  {h['name']}#{h['generation']} pid {h['pid']} on {h['host']}, at "
            f"{_at(h['dumped_at'])}: {h['reason']}"
        )
    shown = a["timeline"][-args.last :] if args.last else []
    if shown:
        print(f"\ntimeline (last {len(shown)}):")
        for e in shown:
            keys = ",".join(e["keys"] or [])
            print(
                f"  {_at(e['t'])} {e['at']:<18} {e['kind']:<7} "
                f"{('#' + str(e['handle'])) if e['handle'] else '':<7} {e['op']:<4} "
                f"{','.join(e['peers']):<16} {_bytes(e['bytes']) if e['bytes'] else '':>10} "
                f"{keys[:40]:<40} {e['info'][:80]}"
            )
    print(f"\nnever completed: {len(a['unfinished'])}")
    for e in sorted(a["unfinished"], key=lambda e: e["t"]):
        print(
            f"  #{e['handle']} {e['op']} of {_bytes(e['bytes'])} from {e['at']} to "
            f"{','.join(e['peers'])}, posted {_at(e['t'])} ({e['age_s']:.1f} s before the dump)"
            f"{' keys ' + ','.join(e['keys']) if e['keys'] else ''}"
        )
    print(f"\nsilent peers: {len(a['silent'])}")
    for s in a["silent"]:
        print(
            f"  {s['peer']}: {s['transfers']} transfers wait for it or timed out on it since "
            f"{_at(s['since'])}; {s['why']}"
        )
    return 0
