"""Small messages over TCP between hosts of a cluster (transport/cluster/).

Over TCP a write lands only while the receiver's agent makes progress. With UCX kept to TCP, an
agent makes it on traffic (NIXL's progress thread, woken by UCX's event file descriptor;
backends/nixl.py), so a receiver that makes no call at all still completes every write and
queues its notifications: the writer here sees each of its 4 KiB writes DONE while the receiver
sits blocked on its stdin, and the receiver then finds the last write's bytes and every
notification. The same path measured: ``transport bench put --link`` runs the writer and the
reader in hosts of their own, every system's bytes checked, and reports what crossed the links.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cluster_peers import ask, start
from transport.cluster import Cluster, Link

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300), pytest.mark.slow]

WRITES = 50

RECEIVER = r"""
import json, sys, time, torch
from transport.backends.nixl import NixlBackend
b = NixlBackend("idle-receiver")
buf = torch.zeros(4096, dtype=torch.uint8)
b.register(buf.data_ptr(), 4096, "cpu")
print(json.dumps({"md": b.metadata([(buf.data_ptr(), 4096, "cpu")]).hex(),
                  "addr": buf.data_ptr(), "progress": b.progress}), flush=True)
expected = int(sys.stdin.readline())  # no call into the agent until the writer is done
# a write is DONE at the writer once its notification left; the progress thread may still be
# queueing the last ones here: read until every one is in (30 s at most), none may be lost
notes, end = [], time.monotonic() + 30
while len(notes) < expected and time.monotonic() < end:
    notes += [m for ms in b.get_notifs().values() for m in ms]
print(json.dumps({"min": int(buf.min()), "max": int(buf.max()),
                  "notes": sorted(int(m) for m in notes)}), flush=True)
"""

WRITER = r"""
import json, sys, time, numpy as np, torch
from transport.backends.base import DONE
from transport.backends.nixl import NixlBackend
md, addr, writes = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
b = NixlBackend("writer")
peer = b.add_peer(md)
src = torch.zeros(4096, dtype=torch.uint8)
b.register(src.data_ptr(), 4096, "cpu")
local = b.prep(None, np.array([(src.data_ptr(), 4096, 0)], dtype=np.uint64), "cpu")
remote = b.prep(peer, np.array([(addr, 4096, 0)], dtype=np.uint64), "cpu")
idx = np.zeros(1, dtype=np.int64)
done = 0
for i in range(1, writes + 1):
    src.fill_(i)
    x = b.make_xfer("WRITE", local, idx, remote, idx, str(i).encode(), peer)
    st, end = b.post(x, str(i).encode(), peer), time.monotonic() + 30
    while st != DONE and time.monotonic() < end:
        st = b.poll(x, peer)
    b.release_xfer(x)
    if st != DONE:
        break
    done += 1
print(json.dumps({"done": done}), flush=True)
"""


def test_an_idle_receiver_completes_small_writes_over_tcp_without_a_call(rights):
    with Cluster(1, Link.parse("1gbit")) as cluster:
        receiver = start(cluster, cluster.generator(0), RECEIVER)
        hello = json.loads(receiver.expect_line(120))
        assert hello["progress"] == "events"  # UCX kept to TCP: the agent wakes on traffic
        writer = start(
            cluster, cluster.trainer, WRITER, hello["md"], str(hello["addr"]), str(WRITES)
        )
        # every write completed while the receiver made no call (30 s each at most)
        assert json.loads(writer.expect_line(240)) == {"done": WRITES}
        got = ask(receiver, str(WRITES))
        assert (got["min"], got["max"]) == (WRITES, WRITES)  # the last write's bytes, all 4096
        assert got["notes"] == list(range(1, WRITES + 1))  # every notification, queued


def test_bench_put_across_hosts_checks_every_system_and_counts_the_link(rights, tmp_path: Path):
    out = tmp_path / "put.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "transport.cli",
            "bench",
            "put",
            "--link",
            "1gbit",
            "--sizes",
            "4K",
            "--batch",
            "none",
            "--op",
            "write",
            "--baselines",
            "raw,mooncake",
            "--budget",
            "0.1",
            "--notify",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    systems = {r["system"]: r for r in results["records"]}
    assert {"ours", "raw-nixl"} <= set(systems)
    assert all(r["verified"] for r in systems.values()), systems
    if "mooncake-tcp" in systems:  # its write, and its write with its own notification
        assert "mooncake-tcp-notify" in systems, sorted(systems)
    else:  # not installed here: skipped with the way to install it
        assert "mooncake-transfer-engine-non-cuda" in results["skipped"]["mooncake"]
    assert any("idle" in n and "progress: events" in n for n in results["notes"])
    # the bytes crossed the trainer's link (the report's last lines)
    trainer = next(ln for ln in done.stdout.splitlines() if ln.strip().startswith("trainer"))
    assert float(trainer.split()[2]) > 0, done.stdout[-1500:]
