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
    add = put.add_argument
    add("--sizes", help=f"comma list of sizes (default {PUT_SIZES}; --quick: {PUT_SIZES_QUICK})")
    add("--max-size", help="drop sizes above this one, e.g. 64M")
    add("--batch", metavar="COUNTxSIZE", help="a batch of COUNT separate tensors in one transfer "
        "(default 1000x64K; --quick: 100x64K; 'none' to skip)")  # fmt: skip
    add("--op", choices=("write", "read", "both"), default="both",
        help="WRITE (put), READ (get) or both (default)")  # fmt: skip
    add("--receivers", type=int, metavar="N",
        help="fan out to N receivers: measures 1, 2, 4, .. and N (default 1)")  # fmt: skip
    add("--budget", type=float, metavar="S",
        help="seconds of timed cycles per configuration (default 1.5; --quick 0.2)")  # fmt: skip
    add("--block", type=int, default=50,
        help="iterations per turn below 1 MiB when systems are interleaved (default 50)")  # fmt: skip
    add("--lanes", help="comma list of lane counts to compare, interleaved: the first is 'ours', "
        "each other one 'ours-lanesN' (default: the Transport's default only)")  # fmt: skip
    _common(put)
    put.set_defaults(run=lambda args: run(args, "put"))

    sync = bsub.add_parser(
        "sync", help="weight sync of a synthetic model to N generators",
        description="One trainer publishes a synthetic state dict to N generators "
        "(WeightPublisher/WeightSubscriber), against raw NIXL writing the same tensors, gloo "
        "broadcast, NCCL broadcast (CUDA) and memcpy.",
    )  # fmt: skip
    add = sync.add_argument
    add("--params", help="parameter count; K/M/G are powers of 1024 (default 256M = 1 GiB of "
        "float32; --quick: 16M)")  # fmt: skip
    add("--tensors", type=int, help="tensor count (default 300; --quick 50)")
    add("--dtypes", default="float32",
        help="comma list of dtypes, assigned to the tensors in turn (default float32)")  # fmt: skip
    add("--generators", type=int, metavar="N", help="receiving processes (default 2)")
    add("--steps", type=int, help="timed syncs per system (default 10; --quick 3)")
    add("--mode", choices=("staging", "inplace"), default="staging",
        help="WeightSubscriber mode (default staging)")  # fmt: skip
    add("--fanout", default="direct", help="comma list of WeightPublisher fan-outs to compare, "
        "interleaved step by step: direct (the trainer writes every generator), chain, tree "
        "(generators relay; staging mode) (default direct)")  # fmt: skip
    add("--degree", type=int, default=2, help="generators each writer serves in a tree (default 2)")
    _common(sync)
    sync.set_defaults(run=lambda args: run(args, "sync"))


def _common(p: argparse.ArgumentParser) -> None:
    on_off = argparse.BooleanOptionalAction
    add = p.add_argument
    add("--baselines", default=",".join(BASELINES), help=f"comma list out of "
        f"{', '.join(BASELINES)}, or 'none' (default: all; nccl only runs where CUDA is present)")  # fmt: skip
    add("--quick", action="store_true", help="a smoke test: small sizes, few iterations (< 30 s)")
    add("--json", metavar="FILE", help="write results and the environment as JSON")
    add("--plot", metavar="FILE.png", help="plot the results (needs matplotlib)")
    add("--progress", action=on_off, help="progress bar on stderr (default: when stderr is a "
        "terminal)")  # fmt: skip
    add("--pin", action=on_off, help="pin the writer to one CPU per lane and each reader to a CPU "
        "of its own while NIXL is measured (default: when the host has CPUs enough for all of "
        "them)")  # fmt: skip
    add("--timeout", type=float, default=120.0, help="seconds one transfer or reply may take")
    add = p.add_argument_group("across hosts").add_argument
    add("--store", metavar="URL",
        help="join this existing store (tcp://, redis://) instead of spawning local readers")  # fmt: skip
    add("--role", choices=ROLES, help="with --store: this process's role")
    add("--peers", metavar="A,B", help="writer: the names of the readers, comma separated")
    add("--name", help="this peer's name (reader: required; writer: bench-writer)")
    add("--namespace", default="bench", help="namespace of the run (default bench)")
    add("--wait", type=float, default=120.0, metavar="S",
        help="how long to wait for the other side (default 120 s)")  # fmt: skip
    p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)  # local readers: pinning


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
