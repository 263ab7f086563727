"""Waiting for a condition another thread or process brings about, under a deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``pred`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        threading.Event().wait(0.01)  # sync-ok: the poll interval of a deadline-bounded wait
