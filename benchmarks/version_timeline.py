"""Where the time of a small version goes, and how many messages it costs: a trainer publishes
versions of ``--params`` float32 parameters in ``--tensors`` tensors to ``--generators``
subscribers (processes of their own, one host, the embedded store), and the flight recorders of
all of them give each version's timeline and its control messages.

Per version, medians over ``--versions`` (after 3 to warm up), in microseconds from the moment
``publish()`` was called:

* ``posted``: the trainer posted the write to the last subscriber;
* ``written``: the trainer's write to the last subscriber completed (its handle);
* ``ver_in``: the last subscriber read the ``ver`` notification;
* ``complete``: the last subscriber's ``wait_for_version`` returned;
* ``published``: the trainer's ``publish().wait()`` returned;

and the messages of one version: what each subscriber took (``ws-in``: begin, ver, ...) and the
notifications the trainer took (credits). The floor to hold it against, measured in the same
processes between the versions: ``floor``, one put of the version's bytes (one tensor) to each
subscriber at once, with the median of ``published / floor`` over the pairs.

    python benchmarks/version_timeline.py [--params 2560K --tensors 400 --generators 2 --versions 20]
        [--layout separate|flat]

``--layout flat`` gives the trainer its tensors as views of one buffer (a model whose parameters
live in one allocation); ``separate`` (the default) allocates each on its own, as Hugging Face
models do, so the publisher first copies them into one buffer (its pack) at every publish.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from transport.cli.bench._util import parse_size


def _spec(params: int, tensors: int) -> dict[str, int]:
    each = params // tensors
    return {f"w{i:04d}": each for i in range(tensors)}


def _subscriber(store: str, name: str, params: int, tensors: int, versions: int) -> None:
    import torch

    import transport
    from transport.weights import WeightSubscriber

    with transport.Transport(name, store, namespace="timeline") as t:
        live = {n: torch.zeros(k) for n, k in _spec(params, tensors).items()}
        t.expose("floor", torch.zeros(sum(x.numel() for x in live.values())))
        sub = WeightSubscriber(t, live)
        print("ready", flush=True)
        done = {}
        for v in range(1, versions + 1):
            sub.wait_for_version(v, timeout=120)
            done[v] = time.time_ns()
        sub.apply()  # every element of version N holds N: the last one arrived whole
        whole = all(float(x.min()) == float(x.max()) == versions for x in live.values())
        print(
            json.dumps({"complete": done, "events": t.recorder.events(), "whole": whole}),
            flush=True,
        )
        sys.stdin.readline()
        sub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="2560K")
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--layout", choices=("separate", "flat"), default="separate")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    args = ap.parse_args()
    params, warm = parse_size(args.params, "--params"), 3
    total = warm + args.versions
    if args.role:
        _subscriber(args.store, args.name, params, args.tensors, args.versions)
        return
    import torch

    import transport
    from transport.store.tcp import TcpStore
    from transport.weights import WeightPublisher

    host = TcpStore("127.0.0.1", 0, hosting="yes")
    names = [f"gen{i}" for i in range(args.generators)]
    cmd = [sys.executable, __file__, "--store", host.url, "--params", args.params]
    cmd += ["--tensors", str(args.tensors), "--versions", str(total)]
    subs = [
        subprocess.Popen(
            [*cmd, "--role", "sub", "--name", n],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in names
    ]
    try:
        for s in subs:
            assert s.stdout is not None and s.stdout.readline().strip() == "ready"
        with transport.Transport("trainer", host, namespace="timeline") as t:
            tensors = {n: torch.zeros(k) for n, k in _spec(params, args.tensors).items()}
            if args.layout == "flat":
                from transport.weights import flat_like

                tensors = flat_like(tensors)
            pub = WeightPublisher(t, tensors)
            while (pub.refresh(), len(pub.subscribers()))[1] < len(names):
                time.sleep(0.01)
            began, ended, floor = {}, {}, {}
            whole = torch.ones(sum(x.numel() for x in tensors.values()))
            for v in range(1, total + 1):
                for x in tensors.values():
                    x.fill_(v)
                began[v] = time.time_ns()
                pub.publish(v, timeout=60).wait(90)
                ended[v] = time.time_ns()
                t0 = time.perf_counter_ns()
                transport.wait_all([t.put(whole, n, "floor") for n in names], 90)
                floor[v] = time.perf_counter_ns() - t0
            mine = t.recorder.events()
        results = [json.loads(s.stdout.readline()) for s in subs]  # type: ignore[union-attr]
    finally:
        for s in subs:
            try:
                s.stdin.write("done\n")  # type: ignore[union-attr]
                s.stdin.flush()  # type: ignore[union-attr]
            except OSError:
                pass
            s.wait(60)
        host.close()
    report = _report(began, ended, floor, mine, results, range(warm + 1, total + 1))
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _report(began, ended, floor, mine, results, versions) -> dict[str, Any]:  # noqa: ANN001
    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    phases: dict[str, list[float]] = {
        k: [] for k in ("posted", "written", "ver_in", "complete", "published", "floor")
    }
    ratios = []
    messages: Counter[str] = Counter()
    for v in versions:
        t0, t1 = began[v], ended[v]
        window = [e for e in mine if t0 <= e["t"] <= t1]
        posts = [e["t"] for e in window if e["kind"] == "post"]
        dones = [e["t"] for e in window if e["kind"] == "done"]
        if posts:
            phases["posted"].append((max(posts) - t0) / 1e3)
        if dones:
            phases["written"].append((max(dones) - t0) / 1e3)
        phases["published"].append((t1 - t0) / 1e3)
        phases["floor"].append(floor[v] / 1e3)
        ratios.append((t1 - t0) / floor[v])
        for e in mine:
            if e["kind"] == "notif" and t0 <= e["t"] < began.get(v + 1, t1 + 10**9):
                messages["trainer took (on " + (e.get("op") or "?") + ")"] += 1
        vers, completes = [], []
        for r in results:
            completes.append(r["complete"][str(v)])
            for e in r["events"]:
                if e["kind"] == "ws-in" and f"version={v}," in e.get("info", ""):
                    messages[f"subscriber took {e['op']}"] += 1
                    if e["op"] == "Ver":
                        vers.append(e["t"])
        if vers:
            phases["ver_in"].append((max(vers) - t0) / 1e3)
        phases["complete"].append((max(completes) - t0) / 1e3)
    n = len(list(versions))
    return {
        "whole": all(r["whole"] for r in results),
        "median_us": {k: med(xs) for k, xs in phases.items() if xs},
        "published_over_floor": round(statistics.median(ratios), 2),
        "messages_per_version": {k: round(c / n, 2) for k, c in sorted(messages.items())},
    }


if __name__ == "__main__":
    main()
