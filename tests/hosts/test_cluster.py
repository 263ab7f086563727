"""A cluster on one machine (transport/cluster/): a store host, a trainer host and two generator
hosts on shaped links. A chained publish crosses the links, every byte checked at both
generators, and the links' own counters show the bytes went over them (the trainer's link
carries each version once, the first generator's forwards it to the second); then nothing of
the cluster is left: no namespace, no process, no state file. A cluster refuses at once where
namespaces cannot be made, and a later one cleans what a killed run left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.processes import PythonProcess
from transport.cluster import Cluster, Link
from transport.cluster.leftovers import load_states

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MiB = 1 << 20
#: four tensors of 4 MiB: 16 MiB a version
TENSORS, NUMEL = 4, MiB

GENERATOR = r"""
import json, sys, torch, transport
store, name, tensors, numel = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = transport.Transport(name, store=store, timeout=30)
sub = transport.WeightSubscriber(
    t, {f"w{i}": torch.zeros(numel) for i in range(tensors)}, group="hosts")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    v = int(line)
    sub.wait_for_version(v, 60)
    sub.apply()
    print(json.dumps({"v": v, "ext": {n: [float(x.min()), float(x.max())]
                                      for n, x in sub.live.items()}}), flush=True)
"""

TRAINER = r"""
import json, sys, torch, transport
store, tensors, numel, gens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = transport.Transport("trainer", store=store, timeout=30)
state = {f"w{i}": torch.zeros(numel) for i in range(tensors)}
pub = transport.WeightPublisher(t, state, group="hosts", fanout="chain")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    v = int(line)
    if v == 0:  # wait for the generators to join
        while len(pub.subscribers()) < gens:
            pub.refresh()
        print(json.dumps({"subscribers": pub.subscribers()}), flush=True)
        continue
    for x in state.values():
        x.fill_(v)
    r = pub.publish(v, timeout=60).wait(90)
    print(json.dumps({"v": v, "status": dict(r.status), "reasons": dict(r.reasons)}), flush=True)
"""


def _send(proc: PythonProcess, line: str, timeout: float = 120) -> dict:
    assert proc.proc.stdin is not None
    proc.proc.stdin.write(line + "\n")
    proc.proc.stdin.flush()
    return json.loads(proc.expect_line(timeout))


def test_a_chained_publish_crosses_the_links_and_nothing_is_left(rights):
    model = TENSORS * NUMEL * 4
    procs: list[PythonProcess] = []
    with Cluster(2, Link.parse("1gbit")) as cluster:
        url = cluster.start_store("tcp")
        prefix = cluster.switch.removesuffix("-switch")

        def run(host, code, *args):  # type: ignore[no-untyped-def]
            p = PythonProcess(code, *args, prefix=tuple(host.command([])),
                              env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"})  # fmt: skip
            procs.append(p)
            return p

        gens = [run(cluster.generator(i), GENERATOR, url, f"gen{i}", str(TENSORS), str(NUMEL))
                for i in range(2)]  # fmt: skip
        trainer = run(cluster.trainer, TRAINER, url, str(TENSORS), str(NUMEL), "2")
        for p in [*gens, trainer]:
            assert json.loads(p.expect_line(120)) == {"ready": True}
        assert _send(trainer, "0") == {"subscribers": ["gen0", "gen1"]}
        before = cluster.traffic()
        for v in (1, 2, 3):
            r = _send(trainer, str(v))
            assert r["status"] == {"gen0": "done", "gen1": "done"}, r["reasons"]
            for g in gens:
                got = _send(g, str(v))
                assert got == {"v": v, "ext": {f"w{i}": [v, v] for i in range(TENSORS)}}
        after = cluster.traffic()
        sent = {role: after[role].sent - before[role].sent for role in after}
        got = {role: after[role].received - before[role].received for role in after}
        print(f"\nbytes over each link for 3 versions of {model / MiB:.0f} MiB: sent {sent}, "
              f"received {got}")  # fmt: skip
        # a chain: the trainer's link carries each version once (plus TCP's framing and the
        # control messages), the first generator forwards it to the second
        assert 3 * model <= sent["trainer"] < 1.2 * 3 * model, sent
        assert 3 * model <= sent["gen0"] < 1.2 * 3 * model, sent
        assert sent["gen1"] < 0.1 * model, sent
        assert 3 * model <= got["gen1"] < 1.2 * 3 * model, got
    for p in procs:  # every process in its hosts was killed with them
        assert p.proc.wait(30) is not None
    assert not [n for n in _namespaces() if n.startswith(prefix + "-")]
    assert cluster.number == 0 and all(s.prefix != prefix for s in load_states().values())


def test_without_the_rights_a_cluster_refuses_at_once_and_says_what_it_needs(rights):
    # a user namespace of its own: this process is nobody there
    done = subprocess.run(
        ["unshare", "-U", sys.executable, "-m", "transport.cli", "cluster", "up", "--generators", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN" in done.stderr, done.stderr


def test_a_later_cluster_removes_what_a_killed_one_left(rights):
    up = subprocess.Popen(
        [sys.executable, "-m", "transport.cli", "cluster", "up", "--generators", "1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        shown = json.loads(up.stdout.readline())
        namespaces = [h["namespace"] for h in shown["hosts"].values()]
        assert set(namespaces) <= set(_namespaces())
        stores = _pids(namespaces[0])  # the store it started, in the store host
        assert stores
    finally:
        up.send_signal(signal.SIGKILL)  # no teardown: a crash
        up.wait(30)
    assert set(namespaces) <= set(_namespaces())  # left behind
    done = subprocess.run([sys.executable, "-m", "transport.cli", "cluster", "down"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and f"[{shown['number']}]" in done.stdout, done
    assert not set(namespaces) & set(_namespaces())
    assert all(not Path(f"/proc/{pid}").exists() for pid in stores)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pids(namespace: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    return out.stdout.split()
