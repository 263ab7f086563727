"""Fixtures for the transfer tests: a store other processes can reach, a local
Transport (the writer), and receivers in child processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.peer import Peer
from helpers.redis_server import ANY_STORE_DB, database, flush
from transport import Store, store_from_url
from transport.store.tcp import TcpStore


@pytest.fixture(params=["tcp", "redis"])
def any_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """The embedded TCPStore, then a real Redis server (this worker's database for it, flushed)."""
    if request.param == "tcp":
        s: Store = TcpStore("127.0.0.1", 0, hosting="yes")
    else:
        url = database(request.getfixturevalue("redis_url"), ANY_STORE_DB)
        flush(url)
        s = store_from_url(url)
    yield s
    s.close()


def start_receiver(store: Store, name: str = "recv", **regions: tuple[str, int, str]) -> Peer:
    return Peer(name, store.url, regions)
