"""Fixtures of the delta tests: subscribers of the delta test model in processes of their own."""

from __future__ import annotations

import pytest

from helpers.delta_peer import DeltaSubscriber, model_spec


@pytest.fixture
def start(tcp_store):
    """Starts ``DeltaSubscriber(name, ...)`` processes on the test's store; stops them after."""
    children = []
    spec = model_spec()

    def make(name, **kwargs):
        child = DeltaSubscriber(name, tcp_store.url, spec, **kwargs)
        children.append(child)
        return child

    yield make
    for c in reversed(children):
        c.stop()
