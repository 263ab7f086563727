"""The GPU's half of stream-ordered transfers, done by the host, so that the proxy thread, the
slots, the handles and the error paths run on machines without a GPU.

``HostStreamOps`` is ``transport.cuda.stream.SlotTable`` with the two kernels of
``csrc/stream_ops.cu`` written out on the host: ``ring`` takes the next sequence number of the
slot and writes the bell; ``wait_kernel`` waits until ``done`` reaches it (or gives up). Everything
else is the library's own code, with a real Transport and real NIXL transfers. Install it with
``install(transport)`` and pass any object as ``stream=``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from helpers import internals
from transport.cuda.proxy import BELL, DONE, GAVE_UP, Slot
from transport.cuda.stream import SlotTable


class HostStreamOps(SlotTable):
    def __init__(self, capacity: int = 64) -> None:
        super().__init__(torch.zeros((capacity, 4), dtype=torch.int64))
        self.counters = torch.zeros(capacity, dtype=torch.int64)
        self.capture = False  # a test sets it to make enqueue() behave as under graph capture

    def capturing(self) -> bool:
        return self.capture

    def ring(self, slot: Slot, stream: Any) -> None:
        seq = int(self.counters[slot.index]) + 1
        self.counters[slot.index] = seq
        self.words[slot.index, BELL] = seq

    def replay(self, slot: Slot) -> int:
        """What a graph replay does to a captured slot: ring again; returns the sequence number."""
        self.ring(slot, None)
        return int(self.counters[slot.index])

    def wait_kernel(self, slot: Slot, stream: Any, timeout: float) -> None:
        seq = int(self.counters[slot.index])
        end = time.monotonic() + timeout
        while int(self.words[slot.index, DONE]) < seq:
            if time.monotonic() > end:
                self.words[slot.index, GAVE_UP] = seq
                return
            time.sleep(50e-6)  # sync-ok: the wait kernel's __nanosleep, between reads of the word


def install(t: Any) -> HostStreamOps:
    ops = HostStreamOps()
    internals.install_stream_ops(t, ops)
    return ops
