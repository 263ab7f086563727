"""``transport peers``: who is in a namespace, what they expose, when they were last heard from,
and which are suspect (their heartbeat stopped: transport/peers/liveness.py)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

from transport import WireFormatError, store_from_url
from transport.peers.directory import Directory
from transport.peers.liveness import suspicion
from transport.store import DEFAULT_STORE_URL
from transport.wire import check_name


def add_parser(sub: Any) -> None:
    p = sub.add_parser("peers", help="list the peers of a namespace", description=__doc__)
    p.add_argument(
        "--store", default=os.environ.get("TRANSPORT_STORE", DEFAULT_STORE_URL), help="store URL"
    )
    p.add_argument("--namespace", default="default")
    p.add_argument(
        "--secret",
        default=os.environ.get("TRANSPORT_SECRET"),
        help="verify records with this shared secret",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="the peers' heartbeat_interval in seconds, to judge which are suspect (default 1)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def client_url(url: str) -> str:
    """A tcp:// URL that never hosts: looking at a store must not start an empty one."""
    if urlsplit(url).scheme == "tcp" and "host=" not in url:
        return url + ("&" if "?" in url else "?") + "host=no"
    return url


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def collect(
    store_url: str, namespace: str, secret: str | None, heartbeat_interval: float = 1.0
) -> list[dict[str, Any]]:
    check_name("namespace", namespace)
    store = store_from_url(client_url(store_url))
    try:
        d = Directory(store, namespace, secret.encode() if secret else None)
        rows: list[dict[str, Any]] = []
        now = time.time()
        for name in d.names():
            try:
                rec = d.fetch(name)
            except WireFormatError as e:
                rows.append({"name": name, "error": str(e)})
                continue
            if rec is None:
                continue
            hb = d.last_heartbeat(name)
            beat = hb[1] if hb and hb[0] == rec.generation else None
            rows.append(
                {
                    "name": rec.name,
                    "generation": rec.generation,
                    "host": rec.host,
                    "pid": rec.pid,
                    "regions": len(rec.regions),
                    "bytes": sum(r.nbytes for r in rec.regions),
                    "last_heartbeat": beat,
                    "heartbeat_age_s": None if beat is None else round(now - beat, 3),
                    "version": rec.version,
                    "suspect": suspicion(hb, rec.generation, heartbeat_interval, now),
                }
            )
        return rows
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    rows = collect(args.store, args.namespace, args.secret, args.heartbeat_interval)
    if args.json:
        print(
            json.dumps({"store": args.store, "namespace": args.namespace, "peers": rows}, indent=2)
        )
        return 0
    if not rows:
        print(f"no peers in namespace {args.namespace!r} of {args.store}")
        return 0
    head = ("NAME", "GEN", "HOST", "PID", "REGIONS", "BYTES", "HEARD", "VERSION")
    table = [head]
    for r in rows:
        if "error" in r:
            table.append(
                (r["name"], "-", "-", "-", "-", "-", "-", "bad record: " + r["error"][:60])
            )
            continue
        age = "never" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.1f} s ago"
        if r["suspect"]:
            age += " (suspect)"
        table.append(
            (
                r["name"],
                str(r["generation"]),
                r["host"],
                str(r["pid"]),
                str(r["regions"]),
                _human(r["bytes"]),
                age,
                r["version"],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
