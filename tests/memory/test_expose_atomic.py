"""Exposing is all or nothing: when the store cannot take the record, none of the regions is
exposed, so the same names can be exposed again once it answers (a weight subscriber made while
the store restarts is made again on the same Transport; found by ``transport chaos``)."""

from __future__ import annotations

import pytest
import torch

import transport
from transport import StoreError
from transport.store import MemoryStore

pytestmark = pytest.mark.unit


class StoreThatFails(MemoryStore):
    """A memory store whose writes of peer records fail while ``down`` is set."""

    down = False

    def set(self, key: str, value: bytes) -> None:
        if self.down and "/peers/" in key:
            raise StoreError(f"the store is down (set {key})")
        super().set(key, value)


def test_an_expose_the_store_refused_leaves_nothing_exposed_and_can_be_made_again():
    store = StoreThatFails()
    with (
        transport.Transport("owner", store=store, backend="loopback", timeout=10) as owner,
        transport.Transport("writer", store=store, backend="loopback", timeout=10) as writer,
    ):
        owner.expose("kept", torch.zeros(16))
        store.down = True
        a, b = torch.zeros(1024), torch.zeros(2048)
        with pytest.raises(StoreError, match="down"):
            owner.expose_all({"a": a, "b": b})
        assert set(owner.regions()) == {"kept"}  # neither a nor b, and kept is still there
        store.down = False
        owner.expose_all({"a": a, "b": b})  # the same names again: no "already exposed"
        assert set(owner.regions()) == {"kept", "a", "b"}
        # and they are what peers see: a put by name lands in the owner's tensor
        writer.put(torch.full((1024,), 7.0), "owner", "a").wait(10)
        assert bool(a.eq(7.0).all())
