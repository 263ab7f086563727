"""``transport bench put`` and ``transport bench sync``: our layer against raw NIXL, gloo, NCCL
and memcpy, in one run.

By default a run spawns its readers as local processes on an embedded store. With ``--store URL
--role writer|reader`` the writer and the readers are started by hand, on any hosts that reach
the store: readers expose memory and serve until the writer says done; the writer measures.
"""

from __future__ import annotations

import argparse
from typing import Any

from transport.cli import CliError

BASELINES = ("raw", "gloo", "memcpy", "nccl")
ROLES = ("writer", "reader")
PUT_SIZES = "4K,64K,1M,16M,64M,256M,1G"
PUT_SIZES_QUICK = "4K,1M,64M"


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark puts and weight syncs against baselines",
                           description=__doc__)  # fmt: skip
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    put = bsub.add_parser(
        "put", help="latency and bandwidth of put/get over sizes",
        description="Latency and bandwidth of our put (WRITE) and get (READ) over sizes, single "
        "tensors and batches, to 1..N receivers, against raw NIXL, gloo, NCCL and memcpy.",
    )  # fmt: skip
    put.add_argument(
        "--sizes",
        default=None,
        help=f"comma list of sizes (default {PUT_SIZES}; --quick: {PUT_SIZES_QUICK})",
    )
    put.add_argument("--max-size", default=None, help="drop sizes above this one, e.g. 64M")
    put.add_argument("--batch", default=None, metavar="COUNTxSIZE",
                     help="a batch of COUNT separate tensors in one transfer (default 1000x64K; "
                     "--quick: 100x64K; 'none' to skip)")  # fmt: skip
    put.add_argument("--op", choices=("write", "read", "both"), default="both",
                     help="WRITE (put), READ (get) or both (default)")  # fmt: skip
    put.add_argument(
        "--receivers",
        type=int,
        default=None,
        metavar="N",
        help="fan out to N receivers: measures 1, 2, 4, .. and N (default 1)",
    )
    put.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="seconds of timed cycles per configuration (default 1.5; --quick 0.2)",
    )
    put.add_argument(
        "--block",
        type=int,
        default=50,
        help="iterations per turn below 1 MiB when systems are interleaved (default 50)",
    )
    put.add_argument(
        "--lanes",
        default=None,
        help="comma list of lane counts to compare, interleaved: the first is 'ours', each other "
        "one 'ours-lanesN' (default: the Transport's default only)",
    )
    _common(put)
    put.set_defaults(run=run_put)

    sync = bsub.add_parser(
        "sync", help="weight sync of a synthetic model to N generators",
        description="One trainer publishes a synthetic state dict to N generators "
        "(WeightPublisher/WeightSubscriber), against raw NIXL writing the same tensors, gloo "
        "broadcast, NCCL broadcast (CUDA) and memcpy.",
    )  # fmt: skip
    sync.add_argument("--params", default=None,
                      help="parameter count; K/M/G are powers of 1024 (default 256M = 1 GiB of "
                      "float32; --quick: 16M)")  # fmt: skip
    sync.add_argument(
        "--tensors", type=int, default=None, help="tensor count (default 300; --quick 50)"
    )
    sync.add_argument(
        "--dtypes",
        default="float32",
        help="comma list of dtypes, assigned to the tensors in turn (default float32)",
    )
    sync.add_argument(
        "--generators", type=int, default=None, metavar="N", help="receiving processes (default 2)"
    )
    sync.add_argument(
        "--steps", type=int, default=None, help="timed syncs per system (default 10; --quick 3)"
    )
    sync.add_argument(
        "--mode",
        choices=("staging", "inplace"),
        default="staging",
        help="WeightSubscriber mode (default staging)",
    )
    sync.add_argument(
        "--fanout",
        default="direct",
        help="comma list of WeightPublisher fan-outs to compare, interleaved step by step: "
        "direct (the trainer writes every generator), chain, tree (generators relay; staging "
        "mode) (default direct)",
    )
    sync.add_argument(
        "--degree", type=int, default=2, help="generators each writer serves in a tree (default 2)"
    )
    _common(sync)
    sync.set_defaults(run=run_sync)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma list out of {', '.join(BASELINES)}, or 'none' (default: all; nccl "
                   "only runs where CUDA is present)")  # fmt: skip
    p.add_argument(
        "--quick", action="store_true", help="a smoke test: small sizes, few iterations (< 30 s)"
    )
    p.add_argument(
        "--json", default=None, metavar="FILE", help="write results and the environment as JSON"
    )
    p.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot the results (needs matplotlib)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin the writer to one CPU per lane and each reader to a CPU of its own while NIXL "
        "is measured (default: when the host has CPUs enough for all of them)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds one transfer or reply may take"
    )
    g = p.add_argument_group("across hosts")
    g.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="join this existing store (tcp://, redis://) instead of spawning local readers",
    )
    g.add_argument("--role", choices=ROLES, default=None, help="with --store: this process's role")
    g.add_argument(
        "--peers",
        default=None,
        metavar="A,B",
        help="writer: the names of the readers, comma separated",
    )
    g.add_argument(
        "--name", default=None, help="this peer's name (reader: required; writer: bench-writer)"
    )
    g.add_argument("--namespace", default="bench", help="namespace of the run (default bench)")
    g.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="S",
        help="how long to wait for the other side (default 120 s)",
    )
    p.add_argument(
        "--cpu", type=int, default=None, help=argparse.SUPPRESS
    )  # local readers: pinning


# -- arguments ----------------------------------------------------------------------------------


def parse_baselines(text: str) -> list[str]:
    if text.strip().lower() == "none":
        return []
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise CliError(
            f"unknown baseline {unknown[0]!r}; known baselines: {', '.join(BASELINES)} (or 'none')"
        )
    return list(dict.fromkeys(names))


def check_roles(args: argparse.Namespace) -> list[str] | None:
    """The reader names a writer drives (None for a local run)."""
    if args.role is None and args.store is None:
        if args.peers or args.name:
            raise CliError("--peers and --name only apply with --store URL --role writer|reader")
        return None
    if args.role is None:
        raise CliError("--store joins an existing store: give --role writer or --role reader too")
    if args.store is None:
        raise CliError(f"--role {args.role} needs --store URL (the store both sides reach)")
    if args.role == "reader":
        if not args.name:
            raise CliError("--role reader needs --name NAME (the writer lists it in --peers)")
        return []
    peers = [p.strip() for p in (args.peers or "").split(",") if p.strip()]
    if not peers:
        raise CliError("--role writer needs --peers NAME[,NAME..]: the readers' names")
    if len(set(peers)) != len(peers):
        raise CliError(f"--peers names a reader twice: {args.peers}")
    return peers


def receiver_counts(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise CliError(f"{name} must be positive, got {value}")


# -- bench put ----------------------------------------------------------------------------------


def put_plan(args: argparse.Namespace, peers: list[str] | None) -> Any:
    from transport.cli.bench._util import parse_batch, parse_size, parse_sizes
    from transport.cli.bench.put import PutPlan

    sizes = parse_sizes(args.sizes or (PUT_SIZES_QUICK if args.quick else PUT_SIZES))
    if args.max_size:
        cap = parse_size(args.max_size, "--max-size")
        sizes = [n for n in sizes if n <= cap]
        if not sizes:
            raise CliError(f"--max-size {args.max_size} leaves no size to measure")
    batch_text = args.batch or ("100x64K" if args.quick else "1000x64K")
    batch = None if batch_text.lower() == "none" else parse_batch(batch_text)
    n = args.receivers
    if n is not None and n < 1:
        raise CliError(f"--receivers must be at least 1, got {n}")
    if peers:
        if n is not None and n != len(peers):
            raise CliError(f"--receivers {n} does not match the {len(peers)} names of --peers")
        n = len(peers)
    n = n or 1
    _positive("--budget", args.budget)
    _positive("--timeout", args.timeout)
    if args.block < 1:
        raise CliError(f"--block must be at least 1, got {args.block}")
    quick = args.quick
    lanes: list[int] = []
    for x in (args.lanes or "").split(","):
        if not x.strip():
            continue
        if not x.strip().isdigit() or not 1 <= int(x) <= 16:
            raise CliError(f"--lanes takes counts from 1 to 16, got {x.strip()!r}")
        lanes.append(int(x))
    return PutPlan(
        sizes=sizes, batch=batch, ops=["write", "read"] if args.op == "both" else [args.op],
        ks=receiver_counts(n), readers=n, baselines=parse_baselines(args.baselines),
        budget_s=args.budget or (0.2 if quick else 1.5), min_cycles=3 if quick else 5,
        max_cycles=20 if quick else 100, block=args.block, dist_budget_s=0.2 if quick else 1.0,
        memcpy_budget_s=0.1 if quick else 0.5, min_iters=3 if quick else 5, timeout=args.timeout,
        pin=args.pin, lanes=list(dict.fromkeys(lanes)),
    )  # fmt: skip


def run_put(args: argparse.Namespace) -> int:
    peers = check_roles(args)
    plan = put_plan(args, peers)
    if args.plot:
        from transport.cli.bench.report import check_plot_support

        check_plot_support()
    if args.role == "reader":
        from transport.cli.bench._session import run_reader
        from transport.cli.bench.put import PutReader

        return run_reader(args, PutReader)
    from transport.cli.bench.put import run_writer

    return run_writer(args, plan, peers)


# -- bench sync ---------------------------------------------------------------------------------


def run_sync(args: argparse.Namespace) -> int:
    from transport.cli.bench import sync

    peers = check_roles(args)
    plan = sync.sync_plan(args, peers)
    if args.plot:
        from transport.cli.bench.report import check_plot_support

        check_plot_support()
    if args.role == "reader":
        from transport.cli.bench._session import run_reader

        return run_reader(args, lambda t, saved: sync.SyncReader(t, saved, plan))
    return sync.run_writer(args, plan, peers)
