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
PUT_SIZES = "4K,64K,1M,16M,64M,256M,1G"  # put.SIZES, without importing torch for --help
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
    put.set_defaults(run=lambda args: run(args, "put"))

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
    sync.set_defaults(run=lambda args: run(args, "sync"))


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
    """1, 2, 4, .. below ``n``, then ``n``."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return [*ks, n]


def positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise CliError(f"{name} must be positive, got {value}")


def run(args: argparse.Namespace, command: str) -> int:
    """``transport bench put|sync``: the writer (local readers, or --role writer) or a reader."""
    from transport.cli.bench import _report, _runner, _session

    peers = check_roles(args)
    if command == "put":
        from transport.cli.bench.put import PutWorkload as Kind
    else:
        from transport.cli.bench.sync import SyncWorkload as Kind  # type: ignore[assignment]
    w = Kind.from_args(args, peers)
    if args.plot:
        _report.check_plot_support()
    if args.role == "reader":
        return _session.run_reader(args, w.buffers)
    return _runner.run_writer(args, w, peers)
