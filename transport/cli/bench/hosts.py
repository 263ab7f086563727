"""``transport bench sync --hosts 1,2,4,8 --link 2gbit``: weight sync across hosts, a trainer host
and N generator hosts of a cluster on this machine (transport/cluster/: network namespaces on
shaped links, UCX kept to TCP over them), for each N in one run. Per N: our WeightPublisher with
each ``--fanout`` (direct: the trainer writes every generator; chain and tree: generators relay;
``chain@1``: with 1 MiB segments), gloo broadcast across the same hosts (what users have without
us; with ``gloo`` in ``--baselines``), and the link floor (the bytes that must cross the busiest
link, divided by its rate). Per system: the time per sync (median of ``--steps``) and the bytes
every link carried per sync (its interface's counters around exactly those syncs). Every
version is checked at every generator (each element equals the version; with ``--delta
SHARE``, a version changes that share of the elements, ours also runs with ``delta=True`` and
``delta="auto"``, and every generator's tensors are compared by digest with the trainer's).

Needs root and iproute2 (namespaces). Where the kernel lacks tc's netem, links take a rate
(tbf) but no delay: see transport/cluster/links.py. The processes in the hosts run this module
with ``--role``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20


# -- the processes in the hosts (this file run with --role) --------------------------------------


def _tensors(mib: int, count: int) -> dict[str, Any]:
    import torch

    numel = mib * MiB // 4 // count
    return {f"w{i}": torch.zeros(numel) for i in range(count)}


def _change(state: dict[str, Any], version: int, share: float) -> None:
    """Version ``version`` of the tensors: every element set to it, or (``share``) the lowest
    bit of that share of them flipped, drawn from the version (sync.mutate)."""
    from transport.cli.bench.sync import mutate

    if not share:
        for x in state.values():
            x.fill_(version)
        return
    mutate(list(state.values()), share, version)


def _digest(state: dict[str, Any]) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        h.update(state[name].numpy().tobytes())
    return h.hexdigest()


def generator(args: argparse.Namespace) -> None:
    """A WeightSubscriber; ``check V [DIGEST]`` answers whether it holds version V whole (every
    element V; or the tensors of that digest)."""
    import transport

    t = transport.Transport(args.name, store=args.store, timeout=60)
    sub = transport.WeightSubscriber(
        t, _tensors(args.mib, args.count), group="hosts", delta=bool(args.delta)
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        _, version, *digest = line.split()
        v = int(version)
        sub.wait_for_version(v, 300)
        sub.apply()
        if digest:
            ok = sub.applied_version == v and _digest(sub.live) == digest[0]
        else:
            ok = sub.applied_version == v and all(
                float(x.min()) == v == float(x.max()) for x in sub.live.values()
            )
        print(json.dumps({"ok": ok}), flush=True)


def trainer(args: argparse.Namespace) -> None:
    """A WeightPublisher; ``sync FANOUT STEPS SEGMENT DELTA`` publishes STEPS versions with
    that fan-out, segment size (bytes; 0: the default) and ``delta`` (off, on, auto)."""
    import transport
    from transport.weights.group import SEGMENT_BYTES

    t = transport.Transport("trainer", store=args.store, timeout=60)
    state = _tensors(args.mib, args.count)
    pub = transport.WeightPublisher(t, state, group="hosts")
    while len(pub.subscribers()) < args.gens:
        pub.refresh()
    print(json.dumps({"ready": True}), flush=True)
    v = 0
    for line in sys.stdin:
        _, fanout, steps, segment, delta = line.split()
        pub.fanout, times, status = fanout, [], {}
        pub.segment_bytes = int(segment) or SEGMENT_BYTES
        modes: dict[str, bool | str] = {"off": False, "on": True, "auto": "auto"}
        pub.delta = modes[delta]
        patched = 0
        for _ in range(int(steps)):
            v += 1
            _change(state, v, args.delta)
            t0 = time.perf_counter()
            r = pub.publish(v, timeout=300).wait(400)
            times.append(time.perf_counter() - t0)
            status = dict(r.status)
            patched += len(r.patched)
        digest = _digest(state) if args.delta else ""
        print(
            json.dumps(
                {
                    "times": times,
                    "status": status,
                    "version": v,
                    "digest": digest,
                    "patched": patched,
                }
            ),
            flush=True,
        )


def gloo(args: argparse.Namespace) -> None:
    """Rank ``args.rank`` of a gloo group: each step, every tensor broadcast from rank 0."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://{args.master}:29600", rank=args.rank, world_size=args.gens + 1
    )
    state = _tensors(args.mib, args.count)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        steps, times = int(line.split()[1]), []
        for v in range(1, steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            for x in state.values():
                if args.rank == 0:
                    x.fill_(v)
                dist.broadcast(x, src=0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            if args.rank and any(
                float(x.min()) != v or float(x.max()) != v for x in state.values()
            ):
                raise SystemExit(f"rank {args.rank}: version {v} did not arrive whole")
        print(json.dumps({"times": times}), flush=True)
    dist.destroy_process_group()


# -- the run -------------------------------------------------------------------------------------


class Proc:
    """A process of this file in a host, one JSON line per command."""

    def __init__(self, cluster: Any, host: Any, *argv: str) -> None:
        self.p = cluster.start(
            host,
            [sys.executable, "-m", __name__, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def line(self, timeout: float = 600) -> dict[str, Any]:
        import select

        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        text = self.p.stdout.readline() if ready else ""
        if not text:
            raise RuntimeError(
                f"a process in the cluster ended or went silent (exit {self.p.poll()})"
            )
        out: dict[str, Any] = json.loads(text)
        return out

    def ask(self, text: str, timeout: float = 600) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()
        return self.line(timeout)


def cpu(procs: list[Proc]) -> float:
    """CPU seconds ``procs`` have used so far, all of them together."""
    from transport.cli.bench._util import process_cpu_seconds

    return sum(process_cpu_seconds(p.p.pid) for p in procs)


def rss_mib(p: Proc) -> float:
    """A process's resident memory now, in MiB."""
    with open(f"/proc/{p.p.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_n(n: int, args: argparse.Namespace) -> dict[str, Any]:
    from transport.cluster import Cluster, Link

    link = Link.parse(args.link)
    model = args.mib * MiB
    out: dict[str, Any] = {"generators": n, "systems": {}}
    with Cluster(n, link) as c:
        url = c.start_store("tcp")
        common = ["--store", url, "--mib", str(args.mib), "--count", str(args.count)]
        common += ["--delta", str(args.delta)]
        gens = [
            Proc(c, c.generator(i), "--role", "gen", "--name", f"gen{i}", *common) for i in range(n)
        ]
        tr = Proc(c, c.trainer, "--role", "trainer", "--gens", str(n), *common)
        for p in [*gens, tr]:
            assert p.line(300) == {"ready": True}

        def measured(name: str, run: Any, procs: list[Proc]) -> None:
            before, cpu0, t0 = c.traffic(), cpu(procs), time.perf_counter()
            own0 = cpu(procs[:1])  # the trainer's (or rank 0's)
            times = run()
            wall, used = time.perf_counter() - t0, cpu(procs) - cpu0
            own = cpu(procs[:1]) - own0
            after = c.traffic()
            per = {role: (after[role].sent - before[role].sent) / args.steps for role in after}
            busy = used / (wall * (os.cpu_count() or 1))
            out["systems"][name] = {
                "median_s": statistics.median(times),
                "times_s": times,
                "sent_per_sync": per,
                "trainer_link_models": per["trainer"] / model,
                "cpu_s_per_sync": used / args.steps,
                "trainer_cpu_s_per_sync": own / args.steps,
                "trainer_rss_mib": rss_mib(procs[0]),
                "cpu_busy": busy,
            }
            print(
                f"N={n} {name}: {statistics.median(times) * 1e3:.0f} ms per sync, trainer's "
                f"link {per['trainer'] / model:.2f} models per sync, {used / args.steps:.2f} "
                f"CPU-s per sync ({100 * busy:.0f}% of the machine's CPUs; the trainer "
                f"{own / args.steps:.2f}, {rss_mib(procs[0]):.0f} MiB resident)",
                flush=True,
            )

        deltas = ["off", "on", "auto"] if args.delta else ["off"]
        patched: list[float] = []  # the share of versions that went as changes
        for system in args.fanout.split(","):
            fanout, _, seg = system.partition("@")  # chain@4: segments of 4 MiB
            segment = int(float(seg) * MiB) if seg else 0
            for delta in deltas:
                # a first version: plans made, slots touched, the base of the next one held
                tr.ask(f"sync {fanout} 1 {segment} {delta}")

                def ours(
                    fanout: str = fanout, segment: int = segment, delta: str = delta
                ) -> list[float]:
                    r = tr.ask(f"sync {fanout} {args.steps} {segment} {delta}")
                    assert set(r["status"].values()) == {"done"}, r
                    for g in gens:
                        ok = g.ask(f"check {r['version']} {r['digest']}".strip())["ok"]
                        assert ok, f"N={n} {fanout} delta {delta}: not whole"
                    patched.append(r["patched"] / (len(gens) * args.steps))
                    times: list[float] = r["times"]
                    return times

                name = f"ours-{fanout}" + (f"-seg{seg}M" if seg else "")
                name += {"off": "", "on": "-delta", "auto": "-auto"}[delta]
                measured(name, ours, [tr, *gens])
                if args.delta:
                    out["systems"][name]["as_changes"] = patched.pop()
                    print(f"  {100 * out['systems'][name]['as_changes']:.0f}% went as changes")
        if args.gloo:
            master = c.trainer.address
            ranks = [
                Proc(
                    c,
                    c.trainer,
                    "--role",
                    "gloo",
                    "--rank",
                    "0",
                    "--master",
                    master,
                    "--gens",
                    str(n),
                    *common,
                )
            ]
            ranks += [
                Proc(
                    c,
                    c.generator(i),
                    "--role",
                    "gloo",
                    "--rank",
                    str(i + 1),
                    "--master",
                    master,
                    "--gens",
                    str(n),
                    *common,
                )
                for i in range(n)
            ]
            for p in ranks:
                assert p.line(300) == {"ready": True}
            for p in ranks:  # a first step: connections made
                p.p.stdin.write("run 1\n")  # type: ignore[union-attr]
                p.p.stdin.flush()  # type: ignore[union-attr]
            for p in ranks:
                p.line()

            def bcast() -> list[float]:
                for p in ranks:
                    p.p.stdin.write(f"run {args.steps}\n")  # type: ignore[union-attr]
                    p.p.stdin.flush()  # type: ignore[union-attr]
                answers = [p.line() for p in ranks]
                times: list[float] = answers[0]["times"]
                return times

            measured("gloo-bcast", bcast, ranks)
    bits = link.bits_per_s
    if bits:
        out["floor_s"] = {"direct": n * model * 8 / bits, "relayed": model * 8 / bits}
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    ns = [r["generators"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in runs[0]["systems"]:
        ax.plot(ns, [r["systems"][name]["median_s"] for r in runs], marker="o", label=name)
    if "floor_s" in runs[0]:
        ax.plot(ns, [r["floor_s"]["direct"] for r in runs], "k:", label="floor (direct)")
        ax.plot(ns, [r["floor_s"]["relayed"] for r in runs], "k--", label="floor (relayed)")
    ax.set_xlabel("generator hosts")
    ax.set_ylabel("time per sync (s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_title(f"{results['mib']} MiB per sync over {results['link']} links")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_hosts(args: argparse.Namespace) -> int:
    """``transport bench sync --hosts``: every N of ``--hosts``, then the table, JSON, plot."""
    from transport import CliError, ClusterError
    from transport.cli.bench import parse_baselines
    from transport.cli.bench._util import parse_size
    from transport.cluster import check_rights

    try:
        check_rights()
        counts = [int(x) for x in args.hosts.split(",")]
    except ClusterError as e:
        raise CliError(str(e)) from e
    except ValueError as e:
        raise CliError(f"--hosts takes generator host counts, such as 1,2,4,8: {e}") from e
    if not counts or min(counts) < 1:
        raise CliError("--hosts takes generator host counts of at least 1, such as 1,2,4,8")
    params = parse_size(args.params or "16M", "--params")
    run = argparse.Namespace(
        link=args.link,
        mib=max(1, params * 4 // MiB),
        count=args.tensors or 32,
        steps=args.steps or 5,
        fanout=args.fanout,
        gloo="gloo" in parse_baselines(args.baselines),
        delta=args.delta or 0.0,
    )
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "link": run.link,
        "mib": run.mib,
        "tensors": run.count,
        "steps": run.steps,
        "delta": run.delta,
        "runs": [],
    }
    for n in counts:
        results["runs"].append(run_n(n, run))
    results["run_s"] = round(time.perf_counter() - t0, 1)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


def table(results: dict[str, Any]) -> str:
    runs = results["runs"]
    ns = [r["generators"] for r in runs]
    head = " | ".join(f"N={n}" for n in ns)
    lines = [f"| system | {head} | N={ns[-1]} / N={ns[0]} |"]
    for name in runs[0]["systems"]:
        ts = [r["systems"][name]["median_s"] for r in runs]
        models = [r["systems"][name]["trainer_link_models"] for r in runs]
        cells = " | ".join(f"{t:.3f} s ({m:.2f}x)" for t, m in zip(ts, models, strict=True))
        lines.append(f"| {name} | {cells} | {ts[-1] / ts[0]:.2f} |")
    if "floor_s" in runs[0]:
        floors = " | ".join(
            f"{r['floor_s']['direct']:.3f} / {r['floor_s']['relayed']:.3f}" for r in runs
        )
        lines.append(f"| floor direct / relayed | {floors} | |")
    lines.append(
        f"(in brackets: models the trainer's link carried per sync); run {results['run_s']:.0f} s"
    )
    return "\n".join(lines)


def main() -> None:
    """A process in a host (``--role``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("gen", "trainer", "gloo"), required=True)
    ap.add_argument("--store")
    ap.add_argument("--name")
    ap.add_argument("--gens", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--master")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--delta", type=float, default=0.0)
    args = ap.parse_args()
    {"gen": generator, "trainer": trainer, "gloo": gloo}[args.role](args)


if __name__ == "__main__":
    main()
