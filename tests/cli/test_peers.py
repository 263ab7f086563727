"""``transport peers`` against real stores and real peers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import torch

import transport
from helpers.processes import REPO, free_port
from transport.peers.directory import Directory
from transport.store.tcp import TcpStore


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transport.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lists_peers_with_regions_and_heartbeats():
    with TcpStore("127.0.0.1", 0, hosting="yes") as store:
        with (
            transport.Transport("gen-0", store=store, namespace="job") as g,
            transport.Transport("trainer", store=store, namespace="job"),
        ):
            g.expose_all({"a": torch.zeros(1024), "b": torch.zeros(256, dtype=torch.uint8)})
            out = cli("peers", "--store", store.url, "--namespace", "job", "--json")
            assert out.returncode == 0, out.stderr
            peers = {p["name"]: p for p in json.loads(out.stdout)["peers"]}
            assert set(peers) == {"gen-0", "trainer"}
            assert peers["gen-0"]["regions"] == 2 and peers["gen-0"]["bytes"] == 4096 + 256
            assert (
                peers["gen-0"]["generation"] == g.generation
                and peers["gen-0"]["last_heartbeat"] is not None
            )
            table = cli("peers", "--store", store.url, "--namespace", "job")
            assert table.returncode == 0
            lines = table.stdout.splitlines()
            assert lines[0].split()[:3] == ["NAME", "GEN", "HOST"]
            assert any(line.startswith("gen-0") and "4.2 KiB" in line for line in lines), (
                table.stdout
            )
            # another namespace is empty
            other = cli("peers", "--store", store.url, "--namespace", "other")
            assert other.returncode == 0 and "no peers" in other.stdout


def test_a_peer_whose_heartbeat_stopped_is_listed_as_suspect():
    """The command judges heartbeats as peers() does (transport/peers/liveness.py), with the peers'
    interval it is given. The stopped heartbeat is written as a stopped process leaves it."""
    with TcpStore("127.0.0.1", 0, hosting="yes") as store:
        with (
            transport.Transport(
                "quiet", store=store, namespace="job", heartbeat_interval=3600
            ) as quiet,
            transport.Transport("alive", store=store, namespace="job"),
        ):
            Directory(store, "job", None).heartbeat("quiet", quiet.generation, at=time.time() - 120)
            out = cli("peers", "--store", store.url, "--namespace", "job", "--json")
            assert out.returncode == 0, out.stderr
            peers = {p["name"]: p for p in json.loads(out.stdout)["peers"]}
            assert peers["alive"]["suspect"] is None
            assert re.search(r"last heartbeat is 1\d\d\.\d s old", peers["quiet"]["suspect"])
            table = cli("peers", "--store", store.url, "--namespace", "job").stdout.splitlines()
            assert any(line.startswith("quiet") and "(suspect)" in line for line in table), table
            assert not any(line.startswith("alive") and "suspect" in line for line in table)
            # peers said to beat every minute are not suspect two minutes after their last beat
            slow = cli(
                "peers",
                "--store",
                store.url,
                "--namespace",
                "job",
                "--json",
                "--heartbeat-interval",
                "60",
            )
            assert {p["name"]: p for p in json.loads(slow.stdout)["peers"]}["quiet"][
                "suspect"
            ] is None


def test_unreachable_store_is_one_line_and_non_zero():
    port = free_port()
    for url in (f"tcp://127.0.0.1:{port}", f"redis://127.0.0.1:{port}/0?timeout=1"):
        out = cli("peers", "--store", url)
        assert out.returncode == 1
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(port) in out.stderr


def test_bad_arguments_exit_non_zero_without_traceback():
    cases = [
        (["peers", "--store", "zk://x:1"], "known schemes: memory://, tcp://"),
        (["peers", "--namespace", "a/b"], "namespace 'a/b' is not allowed"),
        (["nosuch"], "invalid choice: 'nosuch'"),
    ]
    for args, message in cases:
        out = cli(*args)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert message in out.stderr, out.stderr
        assert out.stderr.strip().count("\n") <= 2  # argparse prints usage + one line
