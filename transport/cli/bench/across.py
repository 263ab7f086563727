"""``transport bench put --link RATE``: the same run across hosts of a cluster on this machine.

The writer runs in the cluster's trainer host and each reader in a generator host of its own,
every link shaped as ``--link``, UCX kept to TCP over the links (transport/cluster/). The run
itself is the cross-host mode of the bench (``--store URL --role writer|reader``) started in those
hosts, on an embedded store in the store host; what the writer prints is the report. After it,
the bytes every link carried: a figure that is not near the bytes moved means the run did not
cross the links.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from transport import CliError

#: flags of the local run that the hosts' runs must not get (the launcher's own)
OWN_FLAGS = ("--link",)
#: the writer's name and each reader's
WRITER, READER = "bench-writer", "bench-reader-{}"


def child_argv(argv: Sequence[str], drop: Sequence[str] = OWN_FLAGS) -> list[str]:
    """``argv`` without ``drop``'s flags and their values (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif not any(a.startswith(f + "=") for f in drop):
            out.append(a)
    return out


def run_across(args: argparse.Namespace, readers: int) -> int:
    """Bring up a cluster of ``readers`` generator hosts, run the writer and the readers in it,
    print the bytes on every link; the writer's exit status."""
    from transport import ClusterError
    from transport.cluster import Cluster, Link, check_rights

    try:
        check_rights()
        link = Link.parse(args.link)
    except (ClusterError, ValueError) as e:
        raise CliError(f"--link: {e}") from e
    if args.store is not None or args.role is not None:
        raise CliError("--link runs the writer and the readers itself: drop --store and --role")
    base = [sys.executable, "-m", "transport.cli", *child_argv(args.argv)]
    names = [READER.format(i) for i in range(readers)]
    try:
        with Cluster(readers, link) as c:
            url = c.start_store("tcp")
            roles = ["--store", url, "--namespace", args.namespace]
            for i, name in enumerate(names):
                c.start(
                    c.generator(i),
                    [*base, *roles, "--role", "reader", "--name", name],
                    stdout=subprocess.DEVNULL,
                )
            before = c.traffic()
            writer = c.start(
                c.trainer,
                [*base, *roles, "--role", "writer", "--name", WRITER, "--peers", ",".join(names)],
                stdout=sys.stdout,
                stderr=sys.stderr,
            )
            code = writer.wait()
            after = c.traffic()
    except ClusterError as e:
        raise CliError(str(e)) from e
    print(f"\nbytes on each link over the run ({link}; UCX over TCP):")
    for role in ("trainer", *(f"gen{i}" for i in range(readers))):
        sent = after[role].sent - before[role].sent
        got = after[role].received - before[role].received
        print(f"  {role:8s} sent {sent / 2**20:10.1f} MiB   received {got / 2**20:10.1f} MiB")
    return code
