"""``transport bench sync --hosts``: the same weight sync measured across hosts of a cluster on
this machine, every version checked at every generator (a run that delivers wrong bytes fails),
the bytes each link carried per sync counted by its interface: a chain puts one model on the
trainer's link, direct one per generator; with ``--delta``, versions that change 2% of the
elements put a small part of that there (every generator's tensors compared by digest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600), pytest.mark.slow]


def test_sync_across_two_hosts_counts_the_bytes_on_each_link(rights, tmp_path: Path):
    out = tmp_path / "hosts.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "transport.cli",
            "bench",
            "sync",
            "--hosts",
            "2",
            "--link",
            "1gbit",
            "--params",
            "2M",
            "--tensors",
            "8",
            "--steps",
            "2",
            "--fanout",
            "direct,chain@1",
            "--baselines",
            "gloo",
            "--delta",
            "0.02",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["generators"] == 2
    systems = run["systems"]
    ours = {f"ours-{s}{d}" for s in ("direct", "chain-seg1M") for d in ("", "-delta", "-auto")}
    assert set(systems) == ours | {"gloo-bcast"}
    # 8 MiB per sync: direct writes both generators, a chain one; within framing and control
    assert 2.0 <= systems["ours-direct"]["trainer_link_models"] < 2.2, systems
    assert 1.0 <= systems["ours-chain-seg1M"]["trainer_link_models"] < 1.1, systems
    forwarded = systems["ours-chain-seg1M"]["sent_per_sync"]
    assert max(forwarded["gen0"], forwarded["gen1"]) >= 8 << 20, forwarded  # the relay
    assert run["floor_s"]["direct"] == pytest.approx(2 * run["floor_s"]["relayed"])
    # every version as its changes: 2% of the float32 elements, 6 bytes each, per generator
    delta = systems["ours-direct-delta"]
    assert delta["as_changes"] == 1.0 and delta["trainer_link_models"] < 0.15, delta
    assert systems["ours-direct"]["as_changes"] == 0.0
