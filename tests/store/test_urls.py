"""Opening stores from URLs: errors, Redis auth, and the embedded TCPStore's hosting."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from helpers.processes import REPO, PythonProcess, free_port
from helpers.redis_server import RedisServer
from transport import StoreError, StoreTimeout, store_from_url
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
    host = TcpStore("127.0.0.1", 0, hosting="yes")
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


def test_a_tcp_read_is_one_compare_set_that_changes_nothing() -> None:
    """try_get asks the server to swap the key's value for itself: the answer is the value, or
    the expected one (a form no stored value takes) for a missing key. The read writes nothing:
    a missing key stays missing (a create-if-missing after it still wins, a wait still waits)
    and a present value, of any bytes, reads back as it was."""
    store = TcpStore("127.0.0.1", 0, hosting="yes")
    try:
        assert store.try_get("absent") is None
        assert store.exists("absent") is False
        with pytest.raises(StoreTimeout):
            store.wait(["absent"], timeout=0.2)
        assert store.compare_set("absent", None, b"mine") is True
        odd = [b"0\xff", b"0\xff" + bytes(8), b"\xff", b"\xff" * 9, b"0", b"\x00"]
        for i, value in enumerate(odd):
            store.set(f"k{i}", value)
        for _ in range(3):
            assert [store.try_get(f"k{i}") for i in range(len(odd))] == odd
        assert store.compare_delete("k0", b"0\xff") is True
        assert store.try_get("k0") is None
    finally:
        store.close()


def test_a_tcp_read_of_many_keys_deleted_between_check_and_get_reads_them_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """try_get_many checks that every key exists, then gets them all within a grace of a second
    (a key deleted in between would hold the get for good). A get that runs out falls back to
    reading each key: the deleted one is None, the others their values."""
    import torch.distributed as dist

    real = dist.TCPStore.multi_get
    calls: list[list[str]] = []
    store = TcpStore("127.0.0.1", 0, hosting="yes")

    def multi_get(self: object, keys: list[str]) -> list[bytes]:
        calls.append(list(keys))
        if len(calls) == 1:
            store.delete("b")  # after the check, before the get
            raise dist.DistStoreError("Socket Timeout")  # as the grace running out raises
        return real(self, keys)  # type: ignore[arg-type]

    try:
        for k in "abcd":
            store.set(k, k.encode())
        monkeypatch.setattr(dist.TCPStore, "multi_get", multi_get)
        assert store.try_get_many("abcd") == {"a": b"a", "b": None, "c": b"c", "d": b"d"}
        assert store.try_get_many("acd") == {"a": b"a", "c": b"c", "d": b"d"}  # few: one by one
        assert store.try_get_many("abcd") == {"a": b"a", "b": None, "c": b"c", "d": b"d"}
        assert calls == [list("abcd")]  # a missing key: no multi_get (its check failed)
        store.set("b", b"B")
        assert store.try_get_many("dcba") == {"d": b"d", "c": b"c", "b": b"B", "a": b"a"}
        assert calls == [list("abcd"), list("dcba")]
    finally:
        store.close()
