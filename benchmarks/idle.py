"""What waiting costs: the CPU and wake-ups of idle roles of the library, each in a process of its
own, all idle at once after a first version reached them.

Roles measured: an endpoint (a Transport exposing memory and nothing else), a subscriber, a
relay (a subscriber that forwards to another, in a tree of degree 1), and the leaf below it.
The publisher and the store's host are not measured. For each: the share of a core its whole
process used over ``--seconds``, and the wake-ups (voluntary context switches) of each of its
threads, its engine's among them (threads of no Python name, NIXL's and UCX's, are
``native-<id>``).

    python benchmarks/idle.py [--seconds 60] [--json FILE] [--poll-interval S]

``--poll-interval 0.001`` makes the subscribers poll as they did before the engine slept on its
doorbell (the baseline in one run). Results are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from transport.cli.bench._util import thread_wakeups

ROLES = ("endpoint", "subscriber", "relay", "leaf")


def _role(role: str, store: str, seconds: float, poll: float | None) -> None:
    import torch

    import transport
    from transport.weights import WeightPublisher, WeightSubscriber

    name = role if role != "subscriber" else "sub"
    t = transport.Transport(name, store, namespace=f"idle-{os.getppid()}")
    tensors = {f"w{i}": torch.zeros(4096) for i in range(16)}
    keep: Any = None
    if role == "publisher":
        pub = WeightPublisher(t, {k: v + 1 for k, v in tensors.items()}, fanout="tree", degree=1)
        keep = pub
        while (pub.refresh(), len(pub.subscribers()))[1] < 3:
            time.sleep(0.05)
        pub.publish(1).wait(120)
    elif role == "endpoint":
        t.expose("x", torch.zeros(1 << 20, dtype=torch.uint8), access="rw")
    else:
        options = {} if poll is None else {"poll_interval": poll}
        keep = WeightSubscriber(t, tensors, relay=role != "subscriber", **options)
        keep.wait_for_version(1, timeout=120)
    print("ready", flush=True)
    sys.stdin.readline()  # measure
    wall, cpu, before = time.monotonic(), time.process_time(), thread_wakeups()
    time.sleep(seconds)  # the idle window measured
    after, cpu, wall = thread_wakeups(), time.process_time() - cpu, time.monotonic() - wall
    threads = {n: (c - before.get(n, 0)) / wall for n, c in after.items()}
    engine = next((v for n, v in threads.items() if n.startswith("transport-engine-")), 0.0)
    print(
        json.dumps(
            {
                "role": role,
                "core_share": cpu / wall,
                "engine_wakeups_per_s": engine,
                "switches_per_s": dict(sorted(threads.items(), key=lambda x: -x[1])),
            }
        ),
        flush=True,
    )
    sys.stdin.readline()  # exit
    del keep
    t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--poll-interval", type=float, default=None)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        _role(args.role, args.store, args.seconds, args.poll_interval)
        return
    from transport.store.tcp import TcpStore

    host = TcpStore("127.0.0.1", 0, hosting="yes")
    cmd = [sys.executable, __file__, "--store", host.url, "--seconds", str(args.seconds)]
    if args.poll_interval is not None:
        cmd += ["--poll-interval", str(args.poll_interval)]
    procs = {
        r: subprocess.Popen(
            [*cmd, "--role", r], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in ("publisher", *ROLES)
    }
    try:
        for r, p in procs.items():
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", r
        for r in ROLES:
            procs[r].stdin.write("measure\n")  # type: ignore[union-attr]
            procs[r].stdin.flush()  # type: ignore[union-attr]
        results = [json.loads(procs[r].stdout.readline()) for r in ROLES]  # type: ignore[union-attr]
    finally:
        for p in procs.values():
            try:
                p.stdin.write("exit\n")  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]  (EOF: the publisher was never measured)
            except OSError:
                pass
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        host.close()
    print(f"idle for {args.seconds:g} s (poll_interval {args.poll_interval}):")
    for res in results:
        top = ", ".join(f"{n} {v:.1f}" for n, v in list(res["switches_per_s"].items())[:4])
        print(
            f"  {res['role']:10s} {100 * res['core_share']:5.2f}% of a core, engine thread "
            f"{res['engine_wakeups_per_s']:6.1f} wake-ups/s; all: {top}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"seconds": args.seconds, "poll_interval": args.poll_interval, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
