"""``transport doctor``: which paths this machine will take and why, before a first put.

It reports the versions (the library, torch, NIXL and its plugins, UCX), the settings the library
runs with and the progress mode they give, the devices seen (GPUs, RDMA, network interfaces, the
doorbell's address), the store and its latency (for the embedded store, the reverse name
lookups its connections wait for), the transports UCX picks for a put, a get and a
notification between two processes of this host (``UCX_PROTO_INFO``), a 4 KiB and a 64 MiB put
between them against a copy inside one process, and with ``--peer`` what a named peer's record
says and whether its doorbell is reachable from here. Each problem found comes with the setting
or package that fixes it. The exit status is 1 when a finding is a failure (a put would not
work), else 0. ``--json`` prints the same as JSON."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from transport.cli.doctor import checks
from transport.cli.doctor.report import Loopback, Report
from transport.cli.doctor.routes import RESULT_MARK, parse_routes
from transport.store import DEFAULT_STORE_URL

#: seconds the loopback probe may take in all
PROBE_TIMEOUT = 120.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="which paths this machine will take, and why", description=__doc__
    )
    p.add_argument(
        "--store", default=os.environ.get("TRANSPORT_STORE", DEFAULT_STORE_URL), help="store URL"
    )
    p.add_argument("--namespace", default="default", help="the namespace of --peer")
    p.add_argument("--peer", help="also check this peer of the namespace")
    p.add_argument("--secret", default=os.environ.get("TRANSPORT_SECRET"), help="for --peer")
    p.add_argument("--no-probe", action="store_true", help="skip the loopback probe")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from transport import store_from_url

    report = Report(versions={}, settings={}, progress="", devices={})
    checks.versions(report)
    checks.settings(report, args.store)
    checks.devices(report)
    t0 = time.perf_counter()
    store = store_from_url(args.store)
    try:
        checks.store(report, store, time.perf_counter() - t0)
        checks.name_lookups(report, store.url)
        if args.peer:
            peer(report, store, args.namespace, args.peer, args.secret)
        if not args.no_probe and report.worst() != "fail":
            probe(report, store.url)
    finally:
        store.close()
    print(report.to_json() if args.json else report.to_text())
    return 1 if report.worst() == "fail" else 0


def probe(report: Report, store_url: str) -> None:
    """The loopback probe (probe.py): a reader and a writer process on the store, in a namespace
    of their own; the writer prints UCX's choices and its figures."""
    namespace = f"doctor-{os.getpid()}"
    base = [sys.executable, "-m", "transport.cli.doctor.probe", "--store", store_url]
    base += ["--namespace", namespace]
    reader = subprocess.Popen(
        [*base, "--role", "reader"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout is not None
        ready = reader.stdout.readline().split()
        if not ready or ready[0] != "ready":
            report.add("fail", "probe", "the probe's reader did not start (see its output above)")
            return
        checks.cross_memory(report, bytes.fromhex(ready[1]) if len(ready) > 1 else b"")
        env = dict(os.environ, UCX_PROTO_INFO="y")
        try:
            writer = subprocess.run(
                [*base, "--role", "writer"],
                env=env,
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            report.add(
                "fail", "probe", f"a put between two local processes took over {PROBE_TIMEOUT:g} s"
            )
            return
    finally:
        if reader.stdin is not None:
            try:
                reader.stdin.write("done\n")
                reader.stdin.close()
            except OSError:
                pass
        try:
            reader.wait(30)
        except subprocess.TimeoutExpired:
            reader.kill()
    out = writer.stdout + writer.stderr
    report.routes = parse_routes(out, "two processes on this host")
    line = next((x for x in out.splitlines() if x.startswith(RESULT_MARK)), None)
    if writer.returncode != 0 or line is None:
        tail = " | ".join(out.strip().splitlines()[-3:])
        report.add("fail", "probe", f"a put between two local processes failed: {tail}")
        return
    checks.loopback(report, Loopback(**json.loads(line[len(RESULT_MARK) :])))


def peer(report: Report, store: Any, namespace: str, name: str, secret: str | None) -> None:
    """What ``name``'s record says, whether it beats, and whether its doorbell is reachable."""
    import transport
    from transport.peers.directory import Directory

    d = Directory(store, namespace, secret.encode() if secret else None)
    try:
        rec = d.fetch(name)
    except transport.TransportError as e:
        report.add(
            "fail",
            "peer",
            f"peer {name!r}'s record cannot be read: {e}",
            "the same secret= as the namespace's peers",
        )
        return
    if rec is None:
        report.add(
            "fail",
            "peer",
            f"no peer {name!r} in namespace {namespace!r}",
            "start it, or name its --namespace",
        )
        return
    beat = d.last_heartbeat(name)
    info: dict[str, Any] = {
        "name": f"{rec.name}#{rec.generation}",
        "host": f"{rec.host} (pid {rec.pid})",
        "version": rec.version,
        "regions": len(rec.regions),
        "heartbeat": "never" if beat is None else f"{time.time() - beat[1]:.1f} s ago",
        "doorbell": "none" if rec.bell is None else f"{rec.bell.ip}:{rec.bell.port}",
    }
    report.peer = info
    if rec.version != transport.__version__:
        report.add(
            "warn",
            "peer",
            f"{name} runs transport {rec.version}, this host {transport.__version__}",
            "the same version on every peer",
        )
    if beat is None or time.time() - beat[1] > 10:
        report.add(
            "warn",
            "peer",
            f"{name} has not beaten for {info['heartbeat']}: it may be gone or frozen",
        )
    if rec.bell is None:
        report.add(
            "warn",
            "peer",
            f"{name} publishes no doorbell: what is sent to it waits for its own polls",
        )
        return
    try:
        family = socket.AF_INET6 if ":" in rec.bell.ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((rec.bell.ip, rec.bell.port))
    except OSError as e:
        report.add(
            "warn",
            "peer",
            f"{name}'s doorbell at {rec.bell.ip} has no route from here ({e}): what is sent to it waits up to its idle_interval",
            f"set ${checks.BELL_IP_ENV} on {name}'s host to an address this host reaches",
        )
