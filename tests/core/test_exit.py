"""A process that exits without closing its Transport exits with its own status (NIXL's threads
aborted it, status 134, before Transports were closed at exit) and leaves the namespace."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

EXITS = r"""
import sys, torch, transport
t = transport.Transport("leaves-at-exit", store=sys.argv[1], timeout=10)
t.expose("x", torch.zeros(16))
print("exposed", flush=True)
raise SystemExit(3)
"""


def test_a_process_that_never_closed_exits_with_its_status_and_leaves(tcp_store):
    done = subprocess.run(
        [sys.executable, "-c", EXITS, tcp_store.url],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert "exposed" in done.stdout, done.stderr[-2000:]
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "terminate called" not in done.stderr
    # it left: its record is gone and it is marked as having left
    assert tcp_store.try_get("transport/default/peers/leaves-at-exit") is None
    assert tcp_store.try_get("transport/default/left/leaves-at-exit") is not None
