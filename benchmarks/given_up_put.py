"""Does a put given up at its deadline still land? Across two hosts of a cluster (UCX over TCP):
a writer puts a pattern into a peer's region while the peer cannot take it (its link cut, or
the peer stopped with SIGSTOP), the put fails at its deadline (``TransferTimeout``: the NIXL
transfer is released), then the link comes back (or the peer runs again) and nothing more is
written. The peer's region is read every 0.25 s for ``--watch`` seconds: how many of its bytes
hold the pattern, and when they first did.

    python benchmarks/given_up_put.py [--mib 8] [--deadline 2] [--watch 20] [--trials 3]

Needs the rights ``transport cluster`` needs (network namespaces). Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from transport.cluster import Cluster, Host, Link

#: the peer: exposes a zeroed region; each input line answers how many bytes hold the pattern
PEER = r"""
import json, sys, torch, transport
t = transport.Transport("a", store=sys.argv[1], namespace="late", timeout=10)
n = int(sys.argv[2]) << 20
box = torch.zeros(n, dtype=torch.uint8)
want = (torch.arange(n) % 251 + 1).to(torch.uint8)
t.expose("box", box, access="w")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    print(json.dumps({"landed": int((box == want).sum())}), flush=True)
"""
#: the writer: "warm" (a put of zeros, so the connection exists) or "put SECONDS" (the pattern)
WRITER = r"""
import json, sys, torch, transport
t = transport.Transport("b", store=sys.argv[1], namespace="late", timeout=10)
n = int(sys.argv[2]) << 20
zeros = torch.zeros(n, dtype=torch.uint8)
src = (torch.arange(n) % 251 + 1).to(torch.uint8)
t.register(zeros)
t.register(src)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    word, *rest = line.split()
    err = ""
    try:
        if word == "warm":
            t.put(zeros, "a", "box", timeout=30).wait(60)
        else:
            t.put(src, "a", "box", timeout=float(rest[0])).wait(60)
    except transport.TransportError as e:
        err = type(e).__name__
    print(json.dumps({"error": err}), flush=True)
"""


class Child:
    """One script in one host, driven one JSON line per command."""

    def __init__(self, cluster: Cluster, host: Host, code: str, *args: str) -> None:
        self.proc = cluster.start(
            host,
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.ask(None)["ready"]

    def ask(self, line: str | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(f"the child ended (status {self.proc.poll()})")
        answer: dict[str, Any] = json.loads(out)
        return answer


def trial(how: str, mib: int, deadline: float, watch: float) -> dict[str, Any]:
    with Cluster(1, Link.parse("1gbit")) as cluster:
        url = cluster.start_store("tcp")
        peer = Child(cluster, cluster.trainer, PEER, url, str(mib))
        writer = Child(cluster, cluster.generator(0), WRITER, url, str(mib))
        assert writer.ask("warm")["error"] == ""
        if how == "cut":
            cluster.cut(cluster.trainer)
        else:
            os.kill(peer.proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        failed = writer.ask(f"put {deadline}")
        ended = time.monotonic() - began
        if how == "cut":
            cluster.cut(cluster.trainer, cut=False)
        else:
            os.kill(peer.proc.pid, signal.SIGCONT)
        back = time.monotonic()
        first, landed = None, 0
        while time.monotonic() - back < watch:
            landed = peer.ask("read")["landed"]
            if landed and first is None:
                first = round(time.monotonic() - back, 2)
            if landed == mib << 20:
                break
            time.sleep(0.25)  # the probe's sampling interval
        return {
            "how": how,
            "put": failed["error"] or "landed",
            "put_ended_s": round(ended, 2),
            "landed_bytes_after": landed,
            "of": mib << 20,
            "first_landed_s": first,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--deadline", type=float, default=2.0)
    p.add_argument("--watch", type=float, default=20.0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--how", default="cut,stop")
    a = p.parse_args()
    for how in a.how.split(","):
        for _ in range(a.trials):
            print(json.dumps(trial(how, a.mib, a.deadline, a.watch)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
