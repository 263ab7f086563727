"""A cluster on one machine (transport/cluster/): a store host, a trainer host and two generator
hosts on shaped links. A chained publish crosses the links, every byte checked at both
generators, and the links' own counters show the bytes went over them (the trainer's link
carries each version once, the first generator's forwards it to the second); then nothing of
the cluster is left: no namespace, no process, no state file. A cluster refuses at once where
namespaces cannot be made, and a later one cleans what a killed run left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cluster_peers import GENERATOR, TRAINER, MiB, ask, start, whole
from helpers.processes import PythonProcess
from transport.cluster import Cluster, Link
from transport.cluster.leftovers import load_states

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300), pytest.mark.slow]

#: four tensors of 4 MiB: 16 MiB a version
TENSORS, NUMEL = 4, MiB


def test_a_chained_publish_crosses_the_links_and_nothing_is_left(rights):
    model = TENSORS * NUMEL * 4
    procs: list[PythonProcess] = []
    with Cluster(2, Link.parse("1gbit")) as cluster:
        url = cluster.start_store("tcp")
        prefix = cluster.switch.removesuffix("-switch")

        def run(host, code, *args):  # type: ignore[no-untyped-def]
            procs.append(start(cluster, host, code, *args))
            return procs[-1]

        gens = [
            run(cluster.generator(i), GENERATOR, url, f"gen{i}", str(TENSORS), str(NUMEL))
            for i in range(2)
        ]
        trainer = run(cluster.trainer, TRAINER, url, str(TENSORS), str(NUMEL), "2", "chain")
        for p in [*gens, trainer]:
            assert json.loads(p.expect_line(120)) == {"ready": True}
        assert ask(trainer, "0 0") == {"subscribers": ["gen0", "gen1"]}
        before = cluster.traffic()
        for v in (1, 2, 3):
            r = ask(trainer, f"{v} 60")
            assert r["status"] == {"gen0": "done", "gen1": "done"}, r["reasons"]
            for g in gens:
                assert ask(g, str(v)) == whole(v, TENSORS)
        after = cluster.traffic()
        sent = {role: after[role].sent - before[role].sent for role in after}
        got = {role: after[role].received - before[role].received for role in after}
        print(
            f"\nbytes over each link for 3 versions of {model / MiB:.0f} MiB: sent {sent}, "
            f"received {got}"
        )
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
        [
            "unshare",
            "-U",
            sys.executable,
            "-m",
            "transport.cli",
            "cluster",
            "up",
            "--generators",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN" in done.stderr, done.stderr


def test_a_later_cluster_removes_what_a_killed_one_left(rights):
    """Killed, a cluster leaves its namespaces and its store behind; the next clean removes
    them: ``cluster down``, or a cluster that another test brings up meanwhile (its ``up``
    cleans first, and may take the freed number and the same namespace names). The killed
    cluster's own namespaces are told from a later one's by their inodes."""
    up = subprocess.Popen(
        [sys.executable, "-m", "transport.cli", "cluster", "up", "--generators", "1", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        shown = json.loads(up.stdout.readline())
        namespaces = [h["namespace"] for h in shown["hosts"].values()]
        left = _instances(namespaces)
        assert len(left) == len(namespaces), (left, namespaces)
        stores = _pids(namespaces[0])  # the store it started, in the store host
        assert stores
    finally:
        up.send_signal(signal.SIGKILL)  # no teardown: a crash
        up.wait(30)
    done = subprocess.run(
        [sys.executable, "-m", "transport.cli", "cluster", "down"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done
    assert not set(left.values()) & set(_instances(namespaces).values()), done
    assert all(not Path(f"/proc/{pid}").exists() for pid in stores), done
    state = load_states().get(shown["number"])
    assert state is None or state.owner != up.pid, (state, done)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _pids(namespace: str) -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
    )
    return out.stdout.split()


def _instances(namespaces: list[str]) -> dict[str, int]:
    """Those of ``namespaces`` that exist, each with its inode (a later namespace of the same
    name has another)."""
    found = {}
    for n in set(namespaces) & set(_namespaces()):
        with contextlib.suppress(FileNotFoundError):  # removed since it was listed
            found[n] = os.stat(f"/run/netns/{n}").st_ino
    return found
