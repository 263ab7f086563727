"""``transport bench put`` and ``transport bench sync``: our layer against raw NIXL, gloo, NCCL
and memcpy, in one run.

By default a run spawns its readers as local processes on an embedded store. With ``--store URL
--role writer|reader`` the writer and the readers are started by hand, on any hosts that reach
the store: readers expose memory and serve until the writer says done; the writer measures.
"""

from __future__ import annotations

import argparse
from typing import Any

from transport import CliError

BASELINES = ("raw", "gloo", "memcpy", "nccl", "mooncake", "torch")
PUT_SIZES = "4K,64K,1M,16M,64M,256M,1G"  # put.SIZES, without importing torch for --help
PUT_SIZES_QUICK = "4K,1M,64M"
ON_OFF = argparse.BooleanOptionalAction

# Flags as (FLAG [METAVAR], type | choices | action, default, help), in --help order.
PUT = [
    (
        "--sizes",
        str,
        None,
        f"comma list of sizes (default {PUT_SIZES}; --quick: {PUT_SIZES_QUICK})",
    ),
    ("--max-size", str, None, "drop sizes above this one, e.g. 64M"),
    (
        "--batch COUNTxSIZE",
        str,
        None,
        "a batch of COUNT separate tensors in one transfer "
        "(default 1000x64K; --quick: 100x64K; 'none' to skip)",
    ),
    ("--op", ("write", "read", "both"), "both", "WRITE (put), READ (get) or both (default)"),
    ("--receivers N", int, None, "fan out to N receivers: measures 1, 2, 4, .. and N (default 1)"),
    (
        "--budget S",
        float,
        None,
        "seconds of timed cycles per configuration (default 1.5; --quick 0.2)",
    ),
    (
        "--block",
        int,
        50,
        "iterations per turn below 1 MiB when systems are interleaved (default 50)",
    ),
    (
        "--lanes",
        str,
        None,
        "comma list of lane counts to compare, interleaved: the first is 'ours', "
        "each other one 'ours-lanesN' (default: the Transport's default only)",
    ),
    (
        "--notify",
        "store_true",
        False,
        "each of our writes carries an 8-byte notification, which "
        "the readers drain (with --secret: numbered and MACed); Mooncake, a baseline, "
        "then runs a second time with a notification of its own (mooncake-tcp-notify)",
    ),
    (
        "--link RATE[,DELAY[,LOSS%[,REORDER%[,DUP%]]]]",
        str,
        None,
        "across hosts on this machine (root): the writer "
        "and each reader in a host of their own in a cluster of namespaces (transport cluster), "
        "every link shaped so (e.g. 10gbit), UCX over TCP; reports the bytes on every link",
    ),
]
SYNC: list[tuple[str, Any, Any, str]] = [
    (
        "--params",
        str,
        None,
        "parameter count; K/M/G are powers of 1024 (default 256M = 1 GiB of float32; --quick: 16M)",
    ),
    ("--tensors", int, None, "tensor count (default 300; --quick 50)"),
    (
        "--dtypes",
        str,
        "float32",
        "comma list of dtypes, assigned to the tensors in turn (default float32)",
    ),
    ("--generators N", int, None, "receiving processes (default 2)"),
    ("--steps", int, None, "timed syncs per system (default 10; --quick 3)"),
    ("--mode", ("staging", "inplace"), "staging", "WeightSubscriber mode (default staging)"),
    (
        "--experts",
        int,
        0,
        "a mixture of experts in Hugging Face layout instead of the dense "
        "shape: per layer attention (grouped-query), norms, a router and EXPERTS experts of one "
        "gate, up and down matrix each, --params spread over them (--tensors follows from it)",
    ),
    ("--layers", int, 48, "with --experts: decoder layers (default 48)"),
    (
        "--layout",
        ("separate", "flat"),
        "separate",
        "the trainer's and generators' tensors: "
        "separately allocated (default), or views into one flat buffer per process, as Megatron "
        "and FSDP2 keep parameters",
    ),
    (
        "--fanout",
        str,
        "direct",
        "comma list of WeightPublisher fan-outs to compare, interleaved "
        "step by step: direct (the trainer writes every generator), chain, tree (generators relay; "
        "staging mode) (default direct)",
    ),
    ("--degree", int, 2, "generators each writer serves in a tree (default 2)"),
    (
        "--delta SHARE",
        float,
        0.0,
        "each sync changes SHARE of every tensor's elements (0.022: one step of AdamW at lr "
        "1e-6 in bfloat16, benchmarks/delta_step.py); adds ours-delta (each version as its "
        'changes) and ours-auto (delta="auto") to ours (whole), the generators taking '
        "changes (default 0: whole versions only)",
    ),
    (
        "--hosts N[,N..]",
        str,
        None,
        "across hosts on this machine (root): a trainer host and N "
        "generator hosts of a cluster of namespaces (transport cluster), for each N: ours per "
        "--fanout (FANOUT@MIB: segments of MIB), gloo broadcast, the link floor, bytes on every "
        "link (default --params 16M --tensors 32 --steps 5)",
    ),
    (
        "--link RATE[,DELAY[,LOSS%[,REORDER%[,DUP%]]]]",
        str,
        "2gbit",
        "with --hosts: every link's shape (default 2gbit)",
    ),
    (
        "--trainer-ranks N",
        int,
        None,
        "a sharded trainer of N rank processes (ShardedPublisher), "
        "against gathering to rank 0 with gloo and publishing from there",
    ),
    (
        "--source-shards",
        ("tp", "fsdp"),
        "tp",
        "with --trainer-ranks: how the ranks hold the "
        "matrices: tp (column-parallel along dim 0, row-parallel o and down along dim 1) or fsdp "
        "(all along dim 0) (default tp)",
    ),
    (
        "--strided",
        ("pack", "rows", "both"),
        "pack",
        "with --trainer-ranks: short runs strided in "
        "a shard and adjacent at the generator are packed into the staging pool (one descriptor per "
        "chunk), or written one descriptor per row, or both, interleaved (ours-rows) (default pack)",
    ),
    (
        "--dest-layout",
        ("full", "tp2-fused"),
        "full",
        "with --trainer-ranks: the generators' "
        "layout: whole tensors, or TP=2 shards with fused qkv and gate_up (default full)",
    ),
    (
        "--dest-dtype",
        ("float32", "bfloat16", "fp8"),
        "float32",
        "with --trainer-ranks: the "
        "generators' dtype of the matrices (fp8: e4m3 with 128x128 block scales) (default float32)",
    ),
]
COMMON = [
    (
        "--baselines",
        str,
        ",".join(BASELINES),
        f"comma list out of {', '.join(BASELINES)}, or "
        "'none' (default: all; nccl only runs where CUDA is present)",
    ),
    ("--quick", "store_true", False, "a smoke test: small sizes, few iterations (< 30 s)"),
    ("--json FILE", str, None, "write results and the environment as JSON"),
    ("--plot FILE.png", str, None, "plot the results (needs matplotlib)"),
    ("--progress", ON_OFF, None, "progress bar on stderr (default: when stderr is a terminal)"),
    (
        "--pin",
        ON_OFF,
        None,
        "pin the writer to one CPU per lane and each reader to a CPU of its "
        "own while NIXL is measured (default: when the host has CPUs enough for all of them)",
    ),
    ("--timeout", float, 120.0, "seconds one transfer or reply may take"),
    (
        "--secret",
        "store_true",
        False,
        "join with a shared secret (sealed records, MACs on "
        "notifications): $TRANSPORT_SECRET, or a random one that a local run hands its readers",
    ),
]
HOSTS = [
    (
        "--store URL",
        str,
        None,
        "join this existing store (tcp://, redis://) instead of spawning local readers",
    ),
    ("--role", ("writer", "reader"), None, "with --store: this process's role"),
    ("--peers A,B", str, None, "writer: the names of the readers, comma separated"),
    ("--name", str, None, "this peer's name (reader: required; writer: bench-writer)"),
    ("--namespace", str, "bench", "namespace of the run (default bench)"),
    ("--wait S", float, 120.0, "how long to wait for the other side (default 120 s)"),
]
COMMANDS = {
    "put": (
        "latency and bandwidth of put/get over sizes",
        PUT,
        "Latency and bandwidth of our put "
        "(WRITE) and get (READ) over sizes, single tensors and batches, to 1..N receivers, "
        "against raw NIXL, gloo, NCCL and memcpy.",
    ),
    "sync": (
        "weight sync of a synthetic model to N generators",
        SYNC,
        "One trainer publishes a "
        "synthetic state dict to N generators (WeightPublisher/WeightSubscriber), against raw "
        "NIXL writing the same tensors, gloo broadcast, NCCL broadcast (CUDA) and memcpy.",
    ),
}


def _flags(p: Any, rows: list[tuple[str, Any, Any, str]]) -> None:
    for spec, kind, default, text in rows:
        flag, _, metavar = spec.partition(" ")
        kw: dict[str, Any] = {"default": default, "help": text, "metavar": metavar or None}
        if isinstance(kind, tuple):
            kw["choices"] = kind
        elif isinstance(kind, str) or kind is ON_OFF:
            kw["action"] = kind
            del kw["metavar"]
        elif kind is not str:
            kw["type"] = kind
        p.add_argument(flag, **kw)


def add_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="benchmark puts and weight syncs against baselines", description=__doc__
    )
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for command, (summary, rows, description) in COMMANDS.items():
        p = bsub.add_parser(command, help=summary, description=description)
        _flags(p, rows + COMMON)
        _flags(p.add_argument_group("across hosts"), HOSTS)
        p.add_argument("--cpu", type=int, help=argparse.SUPPRESS)  # local readers: pinning
        p.set_defaults(run=lambda args, c=command: run(args, c))


# -- arguments: each check raises CliError with the flag and the way out ------------------------


def at_least(flag: str, value: int | None, low: int = 1) -> None:
    if value is not None and value < low:
        raise CliError(f"{flag} must be at least {low}, got {value}")


def positive(flag: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise CliError(f"{flag} must be positive, got {value}")


def names(text: str | None) -> list[str]:
    """A comma list, stripped, without empty items."""
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def parse_baselines(text: str) -> list[str]:
    if text.strip().lower() == "none":
        return []
    got = [n.lower() for n in names(text)]
    if unknown := [n for n in got if n not in BASELINES]:
        raise CliError(
            f"unknown baseline {unknown[0]!r}; known baselines: {', '.join(BASELINES)} (or 'none')"
        )
    return list(dict.fromkeys(got))


def count_of(flag: str, given: int | None, peers: list[str] | None, default: int) -> int:
    """A reader count: ``given`` (at least 1), or the number of ``--peers``, which it must match."""
    at_least(flag, given)
    if peers and given is not None and given != len(peers):
        raise CliError(f"{flag} {given} does not match the {len(peers)} names of --peers")
    return len(peers) if peers else default if given is None else given


def check_roles(args: argparse.Namespace) -> list[str] | None:
    """The reader names a writer drives (None for a local run; [] for a reader)."""
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
    if not (peers := names(args.peers)):
        raise CliError("--role writer needs --peers NAME[,NAME..]: the readers' names")
    if len(set(peers)) != len(peers):
        raise CliError(f"--peers names a reader twice: {args.peers}")
    return peers


def run(args: argparse.Namespace, command: str) -> int:
    """``transport bench put|sync``: the writer (local readers, or --role writer) or a reader."""
    from transport.cli.bench import _reader, _report, _runner

    positive("--timeout", args.timeout)
    if command == "sync" and args.hosts is not None:
        from transport.cli.bench.hosts import run_hosts

        return run_hosts(args)
    if command == "sync" and args.trainer_ranks is not None:
        from transport.cli.bench.sharded import run_sharded

        return run_sharded(args)
    if command == "put" and args.link is not None and args.role is None:
        from transport.cli.bench.across import run_across

        at_least("--receivers", args.receivers)
        return run_across(args, args.receivers or 1)
    peers = check_roles(args)
    if command == "put":
        from transport.cli.bench.put import PutWorkload as Kind
    else:
        from transport.cli.bench.sync import SyncWorkload as Kind  # type: ignore[assignment]
    w = Kind.from_args(args, peers)
    if args.plot:
        _report.check_plot_support()
    if args.role == "reader":
        return _reader.run_reader(args, w)
    return _runner.run_writer(args, w, peers)
