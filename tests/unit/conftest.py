"""Fixtures of the unit tests: ``loopback_net`` gives a test its own in-memory store and makes
loopback Transports on it, closing them all at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.loopback_net import LoopbackNet


@pytest.fixture
def loopback_net() -> Iterator[LoopbackNet]:
    """An empty in-memory store; ``loopback_net.make(role)`` adds a loopback Transport to it."""
    net = LoopbackNet()
    yield net
    net.close()
