"""benchmarks/bench_core.py: a thin wrapper around ``transport bench put``.

The benchmark now ships with the library (``transport/cli/bench/``, the ``transport bench``
command); this script only translates the flags it used to take and runs that command with the
``transport`` of the checkout it lives in (so a worktree of a commit measures that commit, its
readers included). See benchmarks/README.md.

    .venv/bin/python benchmarks/bench_core.py --quick --json out.json
    # is: transport bench put --quick --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GONE = {
    "--recv-progress": "the readers make NIXL progress every 0.5 ms (the old 'sleep')",
    "--chunk": "our Transport's default chunk_bytes is measured",
    "--mode": "raw NIXL and ours are always interleaved (the old default)",
    "--separate-buffers": "raw NIXL and ours always share the tensors (the old default)",
    "--rounds": "run the command again and compare the JSON files",
}


def use_tree(root: str) -> None:
    """Import ``transport`` from ``root`` (the finder lives in the package: loaded by its path)."""
    finder = os.path.join(root, "transport", "cli", "bench", "_tree.py")
    if os.path.isfile(finder):
        tree = importlib.util.spec_from_file_location("_transport_tree", finder)
        assert tree is not None and tree.loader is not None
        module = importlib.util.module_from_spec(tree)
        tree.loader.exec_module(module)
        module.use_tree(module.tree_dirs(root))


def translate(argv: Sequence[str]) -> list[str]:
    """The old flags as ``transport bench put`` arguments."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-size")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--systems", help="comma list out of memcpy,raw,gloo,ours (ours always runs)")
    ap.add_argument("--ucx-tls", help="UCX_TLS for this run (tcp also sets UCX_NET_DEVICES=lo)")
    ap.add_argument("--block", type=int)
    ap.add_argument("--batch-count", type=int)
    ap.add_argument("--batch-size")
    ap.add_argument("--iters-scale", type=float, help="scales the time budget per configuration")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None)
    for flag in GONE:
        ap.add_argument(flag, nargs="?", const=True, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag, why in GONE.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            ap.error(f"{flag} is gone: {why}")
    # the old script measured WRITE only, at 4 KiB, 64 MiB and 1 GiB (--quick: up to 64 MiB)
    out = ["bench", "put", "--op", "write", "--sizes", "4K,64M" if args.quick else "4K,64M,1G"]
    if args.quick:
        out.append("--quick")
    for flag in ("max_size", "json", "plot", "block"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    if args.systems is not None:
        systems = {s.strip() for s in args.systems.split(",") if s.strip()}
        out += ["--baselines", ",".join(sorted(systems - {"ours"})) or "none"]
    if args.batch_count is not None or args.batch_size is not None:
        count = args.batch_count if args.batch_count is not None else (100 if args.quick else 1000)
        out += ["--batch", "none" if count == 0 else f"{count}x{args.batch_size or '64K'}"]
    if args.iters_scale is not None:
        out += ["--budget", str((0.2 if args.quick else 1.5) * args.iters_scale)]
    if args.pin is not None:
        out.append("--pin" if args.pin else "--no-pin")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
        if args.ucx_tls.split(",") == ["tcp"]:
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    cli_args = translate(sys.argv[1:] if argv is None else argv)
    use_tree(ROOT)
    from transport.cli import main as transport_main

    print("bench_core.py: transport " + " ".join(cli_args), file=sys.stderr, flush=True)
    sys.argv = ["transport", *cli_args]  # what the JSON records as the command
    return transport_main(cli_args)


if __name__ == "__main__":
    sys.exit(main())
