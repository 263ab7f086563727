"""The ``transport`` command: ``transport peers``, ``transport trace DIR``, ``transport cluster ...``,
``transport chaos``, ``transport doctor``, ``transport bench ...``.

Every failure the user can fix (a bad argument, an unreachable store) ends in
one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from transport import CliError, TransportError


def build_parser() -> argparse.ArgumentParser:
    from transport.cli import chaos, cluster, doctor, peers, trace

    parser = argparse.ArgumentParser(
        prog="transport", description="One-sided tensor transfer: tools."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    peers.add_parser(sub)
    cluster.add_parser(sub)
    chaos.add_parser(sub)
    trace.add_parser(sub)
    doctor.add_parser(sub)
    try:
        bench = importlib.import_module("transport.cli.bench")
    except ModuleNotFoundError as e:  # the bench commands are an optional part of the install
        if e.name != "transport.cli.bench":
            raise
    else:
        bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a run passes on to children
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.run(args)
        return code
    except (CliError, TransportError, ValueError, TypeError) as e:
        print(f"transport {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"transport {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
