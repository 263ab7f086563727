"""``transport cluster``: a cluster of hosts on this machine (network namespaces on shaped links,
transport/cluster/): ``up`` makes one and holds it until Ctrl-C or SIGTERM, ``exec`` runs a
command in one of its hosts, ``down`` removes what dead runs left, ``list`` shows the clusters."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from typing import Any

from transport.cluster import Cluster, Link, clean_leftovers
from transport.cluster.leftovers import load_states


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "cluster", help="hosts on this machine: namespaces on shaped links", description=__doc__
    )
    cmd = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = cmd.add_parser("up", help="make a cluster and hold it until Ctrl-C or SIGTERM")
    up.add_argument("--generators", type=int, default=2, help="generator hosts (default 2)")
    up.add_argument(
        "--link",
        type=Link.parse,
        default=Link(),
        help="every link's shape: RATE[,DELAY[,LOSS%%[,REORDER%%[,DUP%%]]]], such as "
        "2gbit,100us (default: unshaped)",
    )
    up.add_argument(
        "--store",
        choices=("tcp", "redis", "none"),
        default="tcp",
        help="the store the store host runs (default: the embedded store)",
    )
    up.add_argument("--json", action="store_true", help="print the cluster as one JSON line")
    up.set_defaults(run=run_up)
    ex = cmd.add_parser("exec", help="run a command in a host of a cluster (UCX kept to TCP)")
    ex.add_argument("number", type=int, help="the cluster's number (transport cluster list)")
    ex.add_argument("role", help="store, trainer, gen0, gen1, ...")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    ex.set_defaults(run=run_exec)
    down = cmd.add_parser("down", help="remove the clusters whose owner is gone")
    down.add_argument("--all", action="store_true", help="remove every cluster, owned or not")
    down.set_defaults(run=run_down)
    ls = cmd.add_parser("list", help="the clusters on this machine")
    ls.set_defaults(run=run_list)


def run_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(args.generators, args.link) as cluster:
        url = None if args.store == "none" else cluster.start_store(args.store)
        hosts = {
            h.role: {"namespace": h.namespace, "address": h.address} for h in cluster.hosts.values()
        }
        if args.json:
            print(
                json.dumps(
                    {"number": cluster.number, "store": url, "link": str(args.link), "hosts": hosts}
                ),
                flush=True,
            )
        else:
            print(
                f"cluster {cluster.number} up: {args.generators} generator(s), links "
                f"{args.link}; store {url or 'none'}"
            )
            for role, h in hosts.items():
                print(f"  {role:8} {h['address']:13} {h['namespace']}")
            print(
                f"run a command in a host: transport cluster exec {cluster.number} ROLE -- CMD; "
                "Ctrl-C takes it down",
                flush=True,
            )
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    return 0


def run_exec(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ValueError("give the command to run after --")
    state = load_states().get(args.number)
    if state is None:
        raise ValueError(f"no cluster {args.number} here (transport cluster list)")
    namespace = f"{state.prefix}-{args.role}"
    if namespace not in state.namespaces:
        roles = sorted(n.removeprefix(state.prefix + "-") for n in state.namespaces)
        raise ValueError(f"cluster {args.number} has no host {args.role!r}; its hosts: {roles}")
    env = Cluster(1).env()
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], env=env).returncode


def run_down(args: argparse.Namespace) -> int:
    removed = clean_leftovers(everything=args.all)
    print(f"removed cluster(s) {removed}" if removed else "nothing to remove")
    return 0


def run_list(args: argparse.Namespace) -> int:
    states = load_states()
    if not states:
        print("no cluster")
    for number, state in sorted(states.items()):
        print(
            f"cluster {number}: owner {state.owner} ({'alive' if state.alive else 'gone'}), "
            f"{len(state.namespaces)} namespaces",
            file=sys.stdout,
        )
    return 0
