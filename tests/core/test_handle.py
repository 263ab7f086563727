"""A handle completed by one thread and read by another: a waiter that sees it done sees its
error too (the waiter reads the state without a lock)."""

from __future__ import annotations

import sys
import threading

import pytest

import transport
from transport import Handle

pytestmark = pytest.mark.unit


def test_a_waiter_that_sees_a_failed_handle_done_also_sees_its_error():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        seen_without_error = 0
        for _ in range(10_000):
            h = Handle("WRITE", ("peer",), 1, 1)
            err = transport.TransferTimeout("its deadline passed")
            t = threading.Thread(target=h.part_done, args=("peer", err))
            t.start()
            while not h.done():
                pass
            got = h.exception(0)
            t.join()
            if got is None:
                seen_without_error += 1
            else:
                assert got is err
    finally:
        sys.setswitchinterval(old)
    assert seen_without_error == 0, f"{seen_without_error} waiters saw a failed handle succeed"
