"""Shared fixtures. Stores: ``store`` runs a test on every kind, ``interprocess_store``
on the kinds other processes can reach; ``redis_url`` is a real Redis server; ``tcp_store`` is the
embedded store hosted by the test process, and ``writer`` a Transport on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import transport
from helpers.redis_server import (
    CONFORMANCE_DB,
    SHARED_DB,
    RedisServer,
    database,
    external_redis_url,
    flush,
)
from helpers.scheduling import order
from transport import Store, store_from_url
from transport.store import MemoryStore
from transport.store.tcp import TcpStore


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis server (this worker's shared database, never flushed: tests use
    namespaces of their own): started here, or TRANSPORT_TEST_REDIS_URL."""
    external = external_redis_url()
    if external is not None:
        yield database(external, SHARED_DB)
        return
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield database(server.url(0), SHARED_DB)


def _redis_store_url(base_url: str) -> str:
    """``base_url`` moved to this worker's conformance database (flushed by each test)."""
    return database(base_url, CONFORMANCE_DB)


def _open_store(kind: str, request: pytest.FixtureRequest) -> Store:
    if kind == "memory":
        return MemoryStore()
    if kind == "tcp":
        return TcpStore("127.0.0.1", 0, hosting="yes")  # this test's own server, free port
    url = _redis_store_url(request.getfixturevalue("redis_url"))
    flush(url)
    return store_from_url(url)


@pytest.fixture(params=["memory", "tcp", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh, empty store of each kind in turn."""
    opened = _open_store(request.param, request)
    yield opened
    opened.close()


@pytest.fixture(params=["tcp", "redis"])
def interprocess_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh, empty store that child processes can open through ``store.url``."""
    opened = _open_store(request.param, request)
    yield opened
    opened.close()


@pytest.fixture
def tcp_store() -> Iterator[Store]:
    """The embedded store (torch TCPStore) hosted by the test process on a free port."""
    s = TcpStore("127.0.0.1", 0, hosting="yes")
    yield s
    s.close()


@pytest.fixture
def writer(tcp_store: Store) -> Iterator[transport.Transport]:
    """A Transport named "writer" in the test process."""
    with transport.Transport("writer", store=tcp_store, timeout=30) as t:
        yield t


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of the server lane first, in its order, then the long files (helpers/
    scheduling.py): the order the lane runs in, and the order of a run in one process."""

    items.sort(
        key=lambda item: order(item.nodeid)
    )  # stable: a file's tests stay together, in their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` (the test command's): the files that start vLLM servers in one lane,
    the longest files first (helpers/scheduling.py)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from helpers.scheduling import LaneScheduling

    return LaneScheduling(config, log)
