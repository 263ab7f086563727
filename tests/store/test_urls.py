"""Opening stores from URLs: errors, Redis auth, and the embedded TCPStore's hosting."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from helpers.processes import REPO, PythonProcess, free_port
from helpers.redis_server import RedisServer
from transport import StoreError, store_from_url
from transport.store import DEFAULT_STORE_URL, MemoryStore, RedisStore, TcpStore, as_store

pytestmark = [pytest.mark.stores, pytest.mark.timeout(30)]


@pytest.mark.parametrize("url", ["ftp://host:1", "127.0.0.1:29517", "etcd://h:2379", ""])
def test_unknown_scheme_lists_the_known_ones(url: str) -> None:
    with pytest.raises(ValueError) as info:
        store_from_url(url)
    for scheme in ("memory://", "tcp://", "redis://", "rediss://"):
        assert scheme in str(info.value)


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("tcp://127.0.0.1", "tcp://HOST:PORT"),
        ("tcp://:29517", "tcp://HOST:PORT"),
        ("tcp://127.0.0.1:port", "not a number"),
        ("tcp://127.0.0.1:70000", "not a number"),
        ("tcp://127.0.0.1:1?host=maybe", "auto, yes, no"),
        ("tcp://127.0.0.1:1?colour=red", "unknown"),
        ("tcp://127.0.0.1:1?timeout=soon", "timeout"),
        ("tcp://127.0.0.1:1?timeout=-1", "timeout"),
        ("tcp://127.0.0.1:1/path", "path"),
        ("tcp://127.0.0.1:0?host=no", "port 0"),
        ("redis://127.0.0.1:6379/zero", "database"),
        ("redis://127.0.0.1:port/0", "not a number"),
        ("redis:///0", "host"),
        ("redis://127.0.0.1:6379/0?timeout=x", "timeout"),
        ("memory://a/b", "memory://[NAME]"),
    ],
)
def test_malformed_urls_name_the_rule(url: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        store_from_url(url)


def test_a_store_instance_is_returned_unchanged() -> None:
    store = MemoryStore()
    assert store_from_url(store) is store
    assert as_store(store) is store
    with pytest.raises(TypeError):
        store_from_url(42)  # type: ignore[arg-type]


def test_default_url_and_its_environment_override() -> None:
    assert DEFAULT_STORE_URL == "tcp://127.0.0.1:29517"
    code = "from transport.store import DEFAULT_STORE_URL; print(DEFAULT_STORE_URL)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"TRANSPORT_STORE": "redis://elsewhere:6379/2", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=25,
        check=True,
    )
    assert out.stdout.strip() == "redis://elsewhere:6379/2"


def test_memory_urls_share_by_name() -> None:
    first, second = (
        store_from_url("memory://shared-by-name"),
        store_from_url("memory://shared-by-name"),
    )
    private = store_from_url("memory://")
    first.set("k", b"v")
    assert second.get("k", timeout=0) == b"v"
    assert private.try_get("k") is None
    first.close()
    assert second.get("k", timeout=0) == b"v"  # closing one object leaves the others


def test_unreachable_tcp_store_fails_fast_naming_the_url_and_the_way_out() -> None:
    url = f"tcp://127.0.0.1:{free_port()}?timeout=1&host=no"
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        store_from_url(url)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert url in message
    assert "start the process that hosts it first" in message and "redis://" in message


def test_unreachable_redis_fails_fast_with_the_password_masked() -> None:
    url = f"redis://admin:s3cret-pw@127.0.0.1:{free_port()}/0?timeout=1"
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        store_from_url(url)
    assert time.monotonic() - start < 10
    assert "s3cret-pw" not in str(info.value)
    assert "admin:***@127.0.0.1" in str(info.value)
    assert type(info.value.__cause__).__module__.startswith("redis")


def test_redis_with_password_and_database() -> None:
    with RedisServer(password="p@ss word") as server:
        url = server.url(db=3).replace("p@ss word", "p%40ss%20word")
        with store_from_url(url) as store:
            assert isinstance(store, RedisStore)
            assert "p%40ss" not in repr(store) and "***" in repr(store)
            store.set("k", b"in db 3")
            assert store.get("k") == b"in db 3"
        with store_from_url(url.replace("/3", "/4")) as other_db:
            assert other_db.try_get("k") is None
        with pytest.raises(StoreError, match="authentication") as info:
            store_from_url(url.replace("p%40ss%20word", "wrong-pw"))
        assert "wrong-pw" not in str(info.value)
        with pytest.raises(StoreError):
            store_from_url(url.replace(":p%40ss%20word@", ""))


def test_tcp_first_opener_hosts_and_the_next_one_joins() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with store_from_url(url) as host:
        assert isinstance(host, TcpStore) and host.is_host
        host.set("from-host", b"1")
        with store_from_url(url) as guest:
            assert isinstance(guest, TcpStore) and not guest.is_host
            assert guest.get("from-host", timeout=5) == b"1"
            guest.set("from-guest", b"2")
            assert host.get("from-guest", timeout=5) == b"2"
        with pytest.raises(StoreError, match="host=auto"):
            TcpStore.from_url(url + "?host=yes")


def test_tcp_guests_get_store_error_once_the_host_closes() -> None:
    host = TcpStore("127.0.0.1", 0, hosting="yes", timeout=1)
    guest = store_from_url(host.url)
    guest.set("k", b"v")
    host.close()
    assert not host.is_host
    with pytest.raises(StoreError):
        guest.get("k", timeout=5)
    guest.close()


HOST_CHILD = """
import sys
from transport.store import store_from_url
store = store_from_url("tcp://127.0.0.1:0?host=yes")
store.set("from-child", b"hello")
print(store.url, flush=True)
sys.stdin.read()
"""


def test_tcp_store_hosted_by_a_child_process_serves_the_parent() -> None:
    with PythonProcess(HOST_CHILD) as child:
        url = child.expect_line()
        store = store_from_url(url + "?timeout=2")
        assert isinstance(store, TcpStore) and not store.is_host
        assert store.get("from-child", timeout=5) == b"hello"
        failures: list[BaseException] = []
        about_to_get = threading.Event()

        def getter() -> None:
            about_to_get.set()
            try:
                store.get("never", timeout=25)
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=getter)
        thread.start()
        assert about_to_get.wait(10)
        child.kill()  # the host dies: a waiting get fails at once, not at its deadline
        thread.join(10)
        assert not thread.is_alive()
        assert len(failures) == 1 and type(failures[0]) is StoreError
        with pytest.raises(StoreError):
            store.set("k", b"v")
        store.close()


ROLE_CHILD = """
import sys
from transport.store import store_from_url
store = store_from_url(sys.argv[1])
store.add("joined", 1)
print("host" if store.is_host else "guest", flush=True)
sys.stdin.read()
"""


def test_simultaneous_openers_agree_on_one_host() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    children = [PythonProcess(ROLE_CHILD, url) for _ in range(2)]
    try:
        roles = sorted(child.expect_line() for child in children)
        assert roles == ["guest", "host"]
        with store_from_url(url) as store:
            assert isinstance(store, TcpStore) and not store.is_host
            assert store.add("joined", 0) == 2
    finally:
        for child in children:
            child.kill()


def test_a_tcp_get_that_answers_late_is_asked_again_not_taken_for_a_missing_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """try_get checks that the key exists, then gets it within a grace of a second (a key deleted
    in between would hold the get for good). A get that runs out while the key is still there
    was a server slow to answer, as on a loaded host: the value comes back, not None, which had
    made a Transport take its own record for lost (and a publisher a member's entry). A key
    deleted in between is still None."""
    import torch.distributed as dist

    real_get = dist.TCPStore.get
    late: list[str] = []
    store = TcpStore("127.0.0.1", 0, hosting="yes")

    def get(self: object, key: str) -> bytes:
        if key in late:
            late.remove(key)
            if key == "deleted":
                store.delete(key)  # after the check, before the get
            raise dist.DistStoreError("Socket Timeout")  # as the grace running out raises
        return real_get(self, key)

    try:
        store.set("slow", b"v")
        store.set("deleted", b"x")
        monkeypatch.setattr(dist.TCPStore, "get", get)
        late += ["slow", "deleted"]
        assert store.try_get("slow") == b"v"
        assert store.try_get("deleted") is None
        assert late == []  # both gets ran out once
    finally:
        store.close()
