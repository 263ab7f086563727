"""``torch.distributed.Work`` over this library's handles, and timeouts as torch's API takes them."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import Work

from transport import Handle


def check_timeout(timeout: float | None) -> None:
    """torch's rule: None (the endpoint's default) or a finite number of seconds, at least 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be a number of seconds or None, not {type(timeout).__name__}"
        )
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be finite and nonnegative, got {timeout!r}")


class TransferWork(Work):
    """One write or read of a torch-API endpoint: a ``torch.distributed.Work`` over the
    library's :class:`~transport.Handle`.

    It owns the torch future of the transfer. Rules: the future completes on its own when the
    transfer ends, with ``[]`` or the transfer's error (no waiter or event loop needed: the
    engine thread settles it, so its callbacks must be short and never wait on a transfer);
    ``is_completed()`` is true once the transfer ended, failed ones included; ``wait()`` raises
    the transfer's error, and a transfer that missed its deadline fails with
    ``TransferTimeout``, a builtin ``TimeoutError``, after it was withdrawn. A Work made
    without a handle (zero bytes, or a copy between two endpoints of this process) is complete
    at once.
    """

    def __init__(self, handle: Handle | None, on_done: Any = None) -> None:
        super().__init__()
        self._handle = handle
        self._on_done = on_done
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        if handle is None:
            self._future.set_result([])
        else:
            handle.add_done_callback(self._settle)

    def _settle(self, handle: Handle) -> None:
        error = handle.exception(0)
        if self._on_done is not None:
            self._on_done(handle)
        if error is None:
            self._future.set_result([])
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]

    @property
    def handle(self) -> Handle | None:
        """The library's handle of the transfer (None for one complete at once)."""
        return self._handle

    def is_completed(self) -> bool:
        return self._handle is None or self._handle.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        if self._handle is None or not self._handle.done():
            return None
        return self._handle.exception(0)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for the transfer and raise its error. ``timeout`` (0: until the transfer's own
        deadline ends it) bounds this wait only: past it, TimeoutError, and the transfer goes
        on until it completes or its deadline withdraws it."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        check_timeout(seconds)
        if self._handle is not None:
            self._handle.wait(seconds or None)
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return []

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        return f"TransferWork({self._handle!r})"
