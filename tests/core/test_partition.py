"""A network partition between two test hosts, then healed: two network namespaces joined by a
veth pair (documentation addresses 192.0.2.1 and 192.0.2.2, which exist only inside them), UCX over
TCP. Puts time out during the partition (the deadline, never a hang) and succeed again, every byte
checked, once it heals. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from helpers.processes import PythonProcess, free_port

ADDR_A, ADDR_B = "192.0.2.1", "192.0.2.2"

RECEIVER = r"""
import hashlib, json, sys, torch, transport
store, addr = sys.argv[1], sys.argv[2]
t = transport.Transport("recv", store=store, timeout=5)
buf = torch.zeros(1 << 20, dtype=torch.uint8)
t.expose("buf", buf, access="w")
print(json.dumps({"ready": True}), flush=True)
while True:
    for n in t.notifications(timeout=0.5):
        digest = hashlib.sha256(buf.numpy().tobytes()).hexdigest()
        print(json.dumps({"notif": n.payload.decode(), "sha": digest}), flush=True)
"""

WRITER = r"""
import hashlib, json, sys, time, torch, transport
from transport.store.tcp import TcpStore
host, port = sys.argv[1], int(sys.argv[2])
store = TcpStore(host, port, hosting="yes")
t = transport.Transport("writer", store=store, timeout=5)
print(json.dumps({"ready": True}), flush=True)
t.wait_for_peer("recv", 60)
for line in sys.stdin:
    i, timeout = line.split()
    src = torch.full((1 << 20,), int(i) % 251, dtype=torch.uint8)
    t0 = time.monotonic()
    try:
        t.put(src, "recv", "buf", notify=i.encode(), timeout=float(timeout)).wait(30)
        out = {"i": int(i), "ok": True}
    except Exception as e:
        out = {"i": int(i), "ok": False, "error": type(e).__name__, "msg": str(e)[:200]}
    out["s"] = round(time.monotonic() - t0, 3)
    out["sha"] = hashlib.sha256(src.numpy().tobytes()).hexdigest()
    print(json.dumps(out), flush=True)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = str(os.getpid() % 100000)
    a, b, va, vb = f"tpa{tag}", f"tpb{tag}", f"tpva{tag}", f"tpvb{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        _ip("-n", a, "addr", "add", f"{ADDR_A}/24", "dev", va)
        _ip("-n", b, "addr", "add", f"{ADDR_B}/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.skip(f"network namespaces are not available here: {e}")
    try:
        yield a, b, vb
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_partition_times_out_puts_and_healing_brings_them_back(two_hosts):
    a, b, vb = two_hosts
    port = str(free_port())
    env = {"UCX_TLS": "tcp"}  # CMA would cross namespaces: it is one machine
    writer = PythonProcess(WRITER, ADDR_A, port, prefix=("ip", "netns", "exec", a), env=env)
    recv = None
    try:
        assert json.loads(writer.expect_line(60)) == {"ready": True}
        recv = PythonProcess(
            RECEIVER,
            f"tcp://{ADDR_A}:{port}?host=no",
            ADDR_B,
            prefix=("ip", "netns", "exec", b),
            env=env,
        )
        assert json.loads(recv.expect_line(60)) == {"ready": True}

        def put(i: int, timeout: float) -> dict:
            assert writer.proc.stdin is not None
            writer.proc.stdin.write(f"{i} {timeout}\n")
            writer.proc.stdin.flush()
            return json.loads(writer.expect_line(60))

        def landed(i: int, digest: str) -> None:
            while True:
                m = json.loads(recv.expect_line(30))
                if m.get("notif") == str(i):
                    assert m["sha"] == digest, f"put {i}: other bytes landed"
                    return

        first = put(1, 5)
        assert first["ok"], first
        landed(1, first["sha"])
        _ip("-n", b, "link", "set", vb, "down")  # the partition
        try:
            cut = put(2, 1.0)
            assert not cut["ok"] and cut["error"] in ("TransferTimeout", "PeerLostError"), cut
            assert cut["s"] < 10  # the deadline (or a lost connection), never a hang
        finally:
            _ip("-n", b, "link", "set", vb, "up")  # healed
        healed_at = time.monotonic()
        for i in range(3, 60):
            r = put(i, 2.0)
            if r["ok"]:
                landed(i, r["sha"])
                break
            assert time.monotonic() - healed_at < 60, f"not back a minute after healing: {r}"
        else:
            raise AssertionError("no put succeeded after healing")
        print(
            f"\npartition: put failed after {cut['s']} s ({cut['error']}); back "
            f"{time.monotonic() - healed_at:.2f} s after healing"
        )
    finally:
        writer.kill()
        if recv is not None:
            recv.kill()
