"""Fixtures for the weight-sync tests: a store other processes reach, a Transport in the test
process (the trainer), and subscriber and publisher processes that are always cleaned up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import transport
from helpers.ws_peer import PublisherProcess, SubscriberProcess
from transport import Store


@pytest.fixture
def trainer(tcp_store: Store) -> Iterator[transport.Transport]:
    """A Transport named "trainer" in the test process."""
    with transport.Transport("trainer", store=tcp_store, timeout=30) as t:
        yield t


@pytest.fixture
def spawn(tcp_store: Store) -> Iterator[Callable[..., Any]]:
    """``spawn("sub", name, spec, ...)`` or ``spawn("pub", name, spec, ...)`` starts a child on
    the test's store (``wait=False`` to start several at once); all are stopped at the end."""
    children: list[Any] = []

    def start(kind: str, name: str, spec: Any, **kwargs: Any) -> Any:
        cls = SubscriberProcess if kind == "sub" else PublisherProcess
        child = cls(name, tcp_store.url, spec, **kwargs)
        children.append(child)
        return child

    yield start
    for child in reversed(children):
        child.stop()


@pytest.fixture
def children() -> Iterator[list[Any]]:
    """A list to put child processes in (ChildProcess): all are stopped at the end, the last
    started first."""
    out: list[Any] = []
    yield out
    for c in reversed(out):
        c.stop()
