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
from transport.store import MemoryStore, Store, store_from_url
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


#: files of minutes (vLLM servers, clusters of hosts, 100,000 tensors, the GPU dry run's installs),
#: collected first. Under ``--dist loadfile`` xdist then hands out the files with the most tests
#: first (its default reordering, kept on purpose), and these, with few tests each, run last,
#: while the cheap files have freed the CPUs: measured on the whole suite, 1,132 s that way against
#: 1,331 s with these files first, where vLLM servers started side by side and two tests ran past
#: their deadlines. This order decides among files with as many tests, and in one process
#: (TRANSPORT_TEST_WORKERS=0).
LONG_FILES = (
    "integrations/test_vllm_moe_tp2.py",
    "integrations/test_vllm_tp2.py",
    "integrations/test_verl.py",
    "integrations/test_vllm_tp2_server.py",
    "cli/test_bench.py",
    "weights/test_scale.py",
    "test_gpu_check.py",
    "integrations/",
    "hosts/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def longest_first(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, part in enumerate(LONG_FILES) if part in path), len(LONG_FILES))

    items.sort(key=longest_first)  # stable: a file's tests stay together, in their order
