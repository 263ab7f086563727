"""Transports of one test on the in-process loopback backend, and seeded byte patterns.

A :class:`LoopbackNet` is one in-memory store and the Transports a test made on it with
``backend="loopback"``; it gives each a name no other test uses (loopback agents live in one
process-wide table) and closes them all, then the store, at the end. :func:`frozen` stalls a
Transport's agent the way SIGSTOP stalls a process, and always thaws it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

import transport
from transport.backends import loopback
from transport.store import MemoryStore
from transport.weights import flat_like
from transport.wire import agent_name

_nets = itertools.count()


def pattern(n: int, seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``n`` elements of ``dtype`` that depend on ``seed``: random bytes for integer dtypes,
    normal samples (never NaN, so ``torch.equal`` works) for floating ones."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype)


def agent_of(t: transport.Transport) -> str:
    """The backend agent of ``t``'s current incarnation (what :func:`loopback.freeze` takes)."""
    return agent_name(t.name, t.generation)


@contextlib.contextmanager
def frozen(t: transport.Transport) -> Iterator[None]:
    """Hold every transfer and notification to ``t`` until the block ends (a stopped process)."""
    agent = agent_of(t)
    loopback.freeze(agent)
    try:
        yield
    finally:
        loopback.thaw(agent)


class LoopbackNet:
    """One in-memory store and the loopback Transports of one test (see the module docstring)."""

    def __init__(self) -> None:
        self.prefix = f"n{next(_nets)}"
        self.store = MemoryStore()
        self.made: list[transport.Transport] = []

    def name(self, role: str) -> str:
        """The name ``role`` has in this net (unique in the process)."""
        return f"{self.prefix}-{role}"

    def make(self, role: str, **options: Any) -> transport.Transport:
        """A new Transport named after ``role``; ``timeout`` defaults to 10 s."""
        options.setdefault("timeout", 10.0)
        t = transport.Transport(self.name(role), store=self.store, backend="loopback", **options)
        self.made.append(t)
        return t

    def receiver(
        self, role: str, regions: dict[str, torch.Tensor], **options: Any
    ) -> transport.Transport:
        """A Transport that exposes ``regions`` (access "rw")."""
        t = self.make(role, **options)
        t.expose_all(regions)
        return t

    def flat_receiver(
        self, role: str, named: dict[str, torch.Tensor]
    ) -> tuple[transport.Transport, dict[str, torch.Tensor]]:
        """A receiver of zeroed tensors shaped like ``named``, laid out by ``flat_like`` (views of
        one buffer, as a subscriber's staging slot): (its Transport, the tensors)."""
        dst = flat_like(named)
        for t in dst.values():
            t.zero_()
        return self.receiver(role, dst), dst

    def close(self) -> None:
        for t in reversed(self.made):
            t.close()
        self.store.close()
