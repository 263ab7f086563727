"""Shared fixtures; the folders of tests mirror the packages, and what a test needs is a fixture
here or a marker, never its folder.

Stores: ``store`` runs a test on every kind, ``interprocess_store`` and ``any_store`` on the kinds
other processes can reach; ``redis_url`` is a real Redis server; ``tcp_store`` is the embedded
store hosted by the test process, ``writer`` and ``trainer`` Transports on it. ``loopback_net``
makes loopback Transports in this process (marker ``unit``); ``spawn`` and ``children`` start
child processes that are always stopped; ``rights`` skips a test of hosts on network namespaces
(marker ``hosts``) where it may not make them."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import transport
from helpers.loopback_net import LoopbackNet
from helpers.redis_server import (
    ANY_STORE_DB,
    CONFORMANCE_DB,
    SHARED_DB,
    RedisServer,
    database,
    external_redis_url,
    flush,
)
from helpers.scheduling import order
from helpers.ws_peer import PublisherProcess, SubscriberProcess
from transport import ClusterError, Store, store_from_url
from transport.cluster import check_rights
from transport.store import MemoryStore
from transport.store.tcp import TcpStore

#: every Python process the tests start (children, servers, benchmarks, Ray's workers) runs
#: helpers/startup/sitecustomize.py first, and so does this one: the garbage collector's passes
#: come later (the module says why)
STARTUP = Path(__file__).parent / "helpers" / "startup"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(STARTUP), os.environ.get("PYTHONPATH")) if p
)
import helpers.startup.sitecustomize  # noqa: E402, F401  (this process's thresholds)

#: torch's TCPStore looks up the name of the address at each end of every connection it makes
#: (for its log lines, also where nothing is logged), and the address is IPv4 mapped into IPv6,
#: which no hosts file lists: each connection asks the DNS server twice. A resolver that drops
#: queries past a burst (this project's test machines do: benchmarks/README.md) made glibc wait
#: 5 s before it asked again, and tests of many peers stalled at random connections; the
#: processes of the tests wait 1 s. ``transport doctor`` times a burst of such lookups.
os.environ.setdefault("RES_OPTIONS", "timeout:1")


@pytest.fixture(scope="session", autouse=True)
def transport_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder of this pytest process's own (``$TRANSPORT_CACHE_DIR``, inherited by what
    the tests start): the first benchmark of each worker probes UCX, as a user's first run does,
    and none reads what a user's runs kept."""
    folder = tmp_path_factory.mktemp("transport-cache")
    before = os.environ.get("TRANSPORT_CACHE_DIR")
    os.environ["TRANSPORT_CACHE_DIR"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("TRANSPORT_CACHE_DIR", None)
    else:
        os.environ["TRANSPORT_CACHE_DIR"] = before


#: a test past its timeout fails wherever the alarm lands (a ``__del__``, a garbage-collector
#: callback: frames whose exceptions Python drops), and one that goes on ends the process
#: (helpers/timeouts/guard.py)
pytest_plugins = ("helpers.timeouts.guard",)


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


@pytest.fixture
def writer(tcp_store: Store) -> Iterator[transport.Transport]:
    """A Transport named "writer" in the test process."""
    with transport.Transport("writer", store=tcp_store, timeout=30) as t:
        yield t


@pytest.fixture
def trainer(tcp_store: Store) -> Iterator[transport.Transport]:
    """A Transport named "trainer" in the test process."""
    with transport.Transport("trainer", store=tcp_store, timeout=30) as t:
        yield t


@pytest.fixture
def loopback_net() -> Iterator[LoopbackNet]:
    """An empty in-memory store; ``loopback_net.make(role)`` adds a loopback Transport to it."""
    net = LoopbackNet()
    yield net
    net.close()


@pytest.fixture
def spawn(tcp_store: Store) -> Iterator[Callable[..., Any]]:
    """``spawn("sub", name, spec, ...)`` or ``spawn("pub", name, spec, ...)`` starts a child on
    the test's store (``wait=False`` to start several at once); all are stopped at the end."""
    started: list[Any] = []

    def start(kind: str, name: str, spec: Any, **kwargs: Any) -> Any:
        cls = SubscriberProcess if kind == "sub" else PublisherProcess
        child = cls(name, tcp_store.url, spec, **kwargs)
        started.append(child)
        return child

    yield start
    for child in reversed(started):
        child.stop()


@pytest.fixture
def children() -> Iterator[list[Any]]:
    """A list to put child processes in (ChildProcess): all are stopped at the end, the last
    started first."""
    out: list[Any] = []
    yield out
    for c in reversed(out):
        c.stop()


@pytest.fixture
def rights() -> None:
    """Skip, with the reason, where this process may not make network namespaces (root and
    iproute2; the test command runs as root in CI, so there they run)."""
    try:
        check_rights()
    except ClusterError as e:
        pytest.skip(str(e))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of the server lane first, in its order, then the long files (helpers/
    scheduling.py): the order the lane runs in, and the order of a run in one process."""

    items.sort(
        key=lambda item: order(item.nodeid)
    )  # stable: a file's tests stay together, in their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported and built (torch, vLLM's modules where a file imports them, the
    test items) stays for the whole run: frozen out of the garbage collector's passes, which
    would otherwise walk it again at every full pass of every test."""
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` (the test command's): the files that start vLLM servers in one lane,
    the longest files first (helpers/scheduling.py)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from helpers.scheduling import LaneScheduling

    return LaneScheduling(config, log)
