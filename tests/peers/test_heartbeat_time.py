"""The time a heartbeat carries is the time it was written (``Directory.heartbeat``), on every
store: a heartbeat whose read of the store the network held (a link cut, then healed) must not
land with the time its beat began, or a peer heard again looks as old as the cut a moment
later. The read is held by a store that runs a hook right after it answers (no timing involved:
the hook notes the wall time at that point, and the heartbeat written must not be older)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from helpers.stores import ForwardingStore
from transport import Store
from transport.peers.directory import Directory

pytestmark = [pytest.mark.stores, pytest.mark.timeout(60)]

NS = "heartbeat-time"
NAME = "gen-0"


class AfterRead(ForwardingStore):
    """``inner`` as it is, except that ``hook`` runs right after each read of ``key``."""

    def __init__(self, inner: Store, key: str, hook: Callable[[], None]) -> None:
        super().__init__(inner)
        self.key, self.hook = key, hook

    def try_get(self, key: str) -> bytes | None:
        raw = self.inner.try_get(key)
        if key == self.key:
            self.hook()
        return raw


@pytest.mark.parametrize("before", ["none", "its own"])
def test_a_heartbeat_carries_the_time_after_its_read_of_the_store(store: Store, before: str):
    """``before``: what the store holds as the beat reads (none yet, or its own last one)."""
    plain = Directory(store, NS, None)
    gen = plain.join(NAME)
    if before == "its own":
        assert plain.heartbeat(NAME, gen, at=time.time() - 60)
    answered: list[float] = []
    held = Directory(
        AfterRead(store, plain.heartbeat_key(NAME), lambda: answered.append(time.time())), NS, None
    )

    assert held.heartbeat(NAME, gen)

    beat = plain.last_heartbeat(NAME)
    assert answered and beat is not None and beat[0] == gen
    assert beat[1] >= answered[-1], (
        f"the heartbeat is {answered[-1] - beat[1]:.6f} s older than its read"
    )
