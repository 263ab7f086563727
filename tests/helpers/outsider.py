"""An outsider: its own NIXL agent, driven without any Transport rule, as an attacker would.

It can load a peer's connection metadata (if it can read it), write and read that peer's memory
by address, and send it notification frames under any agent name it likes. Every wait is
bounded; a failure raises.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from helpers.polling import wait_until
from transport.backends.base import DONE, READ, WRITE
from transport.backends.nixl import NixlBackend


class Outsider:
    """One NIXL agent named ``agent`` (for example ``gen-0#1``, a name a real peer might have),
    with a thread that makes its progress (NIXL's own progress thread is off, and a notification
    leaves only while its sender makes progress)."""

    def __init__(self, agent: str) -> None:
        self.backend = NixlBackend(agent)
        self.buf = torch.zeros(1 << 16, dtype=torch.uint8)
        self._reg = self.backend.register(self.buf.data_ptr(), self.buf.nbytes, "cpu")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, daemon=True)
        self._thread.start()

    def _progress(self) -> None:
        while not self._stop.wait(1e-3):
            self.backend.get_notifs()

    def load(self, metadata: bytes) -> str:
        """Load a peer's metadata; the agent name it names (BackendError for garbage)."""
        return self.backend.add_peer(metadata)

    def _xfer(self, op: str, agent: str, addr: int, nbytes: int) -> None:
        be = self.backend
        local = be.prep(None, np.array([[self.buf.data_ptr(), nbytes, 0]], dtype=np.int64), "cpu")
        remote = be.prep(agent, np.array([[addr, nbytes, 0]], dtype=np.int64), "cpu")
        idx = np.array([0], dtype=np.int64)
        xfer = be.make_xfer(op, local, idx, remote, idx, b"", agent)
        try:
            st = be.post(xfer, b"", agent)
            if st != DONE:
                wait_until(lambda: be.poll(xfer, agent) == DONE, 30, f"the outsider's {op}")
        finally:
            be.release_xfer(xfer)
            be.release_prepped(local)
            be.release_prepped(remote)

    def write(self, agent: str, addr: int, data: bytes) -> None:
        self.buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._xfer(WRITE, agent, addr, len(data))

    def read(self, agent: str, addr: int, nbytes: int) -> bytes:
        self._xfer(READ, agent, addr, nbytes)
        return bytes(self.buf[:nbytes].numpy().tobytes())

    def notify(self, agent: str, frame: bytes) -> None:
        self.backend.send_notif(agent, frame, agent)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.backend.deregister(self._reg)
        self.backend.close()
