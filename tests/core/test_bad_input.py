"""Bad input: each a clear error that names the rule, with nothing written and nothing hung."""

from __future__ import annotations

import msgpack
import pytest
import torch

import transport
from helpers.peer import Peer, sha
from transport.store.tcp import TcpStore
from transport.wire import FORMAT_VERSION, MAX_RECORD_BYTES

ZEROS = sha(torch.zeros(4096, dtype=torch.float32))


@pytest.fixture(scope="module")
def store():
    s = TcpStore("127.0.0.1", 0, hosting="yes")
    yield s
    s.close()


@pytest.fixture(scope="module")
def receiver(store):
    regions = {
        "rw": ("float32", 4096, "rw"),
        "ro": ("float32", 4096, "r"),
        "wo": ("float32", 4096, "w"),
    }
    with Peer("recv", store.url, regions) as p:
        yield p


@pytest.fixture(scope="module")
def w(store, receiver):
    with transport.Transport("writer", store=store, timeout=10) as t:
        t.wait_for_peer("recv", 30)
        yield t


@pytest.fixture(autouse=True)
def untouched(receiver):
    """After every test here, the receiver's regions hold exactly what they held before: zeros."""
    receiver.call("zero", "rw")
    yield
    assert receiver.call("shas", ["rw", "ro", "wo"]) == {"rw": ZEROS, "ro": ZEROS, "wo": ZEROS}


def test_non_contiguous_source(w):
    src = torch.zeros(64, 64).t()
    with pytest.raises(ValueError, match=r"not contiguous; call \.contiguous\(\)"):
        w.put(src, "recv", "rw")


def test_wrong_dtype(w):
    with pytest.raises(transport.RegionError, match="tensor is float64, the region is float32"):
        w.put(torch.ones(4096, dtype=torch.float64), "recv", "rw")


def test_too_large_for_the_region(w):
    with pytest.raises(transport.RegionError, match="do not fit region 'rw'"):
        w.put(torch.ones(4097), "recv", "rw")
    with pytest.raises(transport.RegionError, match="do not fit"):
        w.put(torch.ones(10), "recv", "rw", offset=4090)


def test_unknown_region(w):
    with pytest.raises(transport.RegionError, match="has no region 'nope'; it exposes 3 regions"):
        w.put(torch.ones(16), "recv", "nope")


def test_unknown_peer(w):
    with pytest.raises(
        transport.PeerNotFoundError, match="no peer named 'ghost'.*known peers: recv"
    ):
        w.put(torch.ones(16), "ghost", "rw")


def test_write_into_read_only_region(w):
    with pytest.raises(transport.RegionError, match="read-only"):
        w.put(torch.ones(16), "recv", "ro")


def test_read_from_write_only_region(w):
    with pytest.raises(transport.RegionError, match="write-only"):
        w.get(torch.ones(16), "recv", "wo")


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_bad_arguments(w):
    with pytest.raises(TypeError, match="torch.Tensor"):
        w.put([1, 2, 3], "recv", "rw")
    with pytest.raises(ValueError, match="offset must be"):
        w.put(torch.ones(4), "recv", "rw", offset=-1)
    with pytest.raises(ValueError, match="timeout must be"):
        w.put(torch.ones(4), "recv", "rw", timeout=0)
    with pytest.raises(ValueError, match="list of peers is empty"):
        w.put(torch.ones(4), [], "rw")
    with pytest.raises(ValueError, match="appears twice"):
        w.put(torch.ones(4), ["recv", "recv"], "rw")
    with pytest.raises(TypeError, match="notify must be bytes"):
        w.put(torch.ones(4), "recv", "rw", notify="text")
    if not torch.cuda.is_available():  # tests/cuda/test_stream.py has the rest
        with pytest.raises(RuntimeError, match="no CUDA device"):
            w.put(torch.ones(4), "recv", "rw", stream=object())
    with pytest.raises(ValueError, match="key= cannot be combined with a dict"):
        w.put({"rw": torch.ones(4)}, "recv", "rw")
    with pytest.raises(TypeError, match="not supported"):
        w.put(torch.ones(4, dtype=torch.complex32), "recv", "rw")


def test_batch_is_checked_whole_before_anything_moves(w):
    batch = {"rw": torch.ones(4096), "ro": torch.ones(4096)}  # the second is read-only
    with pytest.raises(transport.RegionError, match="read-only"):
        w.put(batch, "recv")


def test_fan_out_is_checked_for_every_peer_first(w):
    with pytest.raises(transport.PeerNotFoundError):
        w.put(torch.ones(4096), ["recv", "ghost"], "rw")


def test_closed_transport(store, receiver):
    t = transport.Transport("short-lived", store=store)
    t.close()
    t.close()  # idempotent
    with pytest.raises(transport.ClosedError, match="is closed; open a new Transport"):
        t.put(torch.ones(16), "recv", "rw")
    with pytest.raises(transport.ClosedError):
        t.expose("x", torch.ones(4))
    with pytest.raises(transport.ClosedError):
        t.wait_for_peer("recv", 1)


def test_unknown_store_url():
    with pytest.raises(ValueError, match=r"memory://, tcp://, redis://, rediss://"):
        transport.Transport("x", store="zookeeper://host:2181")


def test_unreachable_store():
    from helpers.processes import free_port

    port = free_port()
    with pytest.raises(transport.StoreError, match=f"127.0.0.1:{port}"):
        transport.Transport("x", store=f"tcp://127.0.0.1:{port}?host=no&timeout=1")
    with pytest.raises(transport.StoreError, match="cannot|could not|unreachable|refused"):
        transport.Transport("x", store=f"redis://:secret@127.0.0.1:{port}/0?timeout=1")


def test_bad_names(store):
    with pytest.raises(ValueError, match="peer name 'a/b' is not allowed"):
        transport.Transport("a/b", store=store)
    with pytest.raises(ValueError, match="namespace"):
        transport.Transport("ok", store=store, namespace="")


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\xc1\xc1garbage", "not valid msgpack"),
        (msgpack.packb({"v": 99, "kind": "peer", "body": b"", "sig": None}), "format version 99"),
        (msgpack.packb({"v": FORMAT_VERSION, "kind": "peer", "body": b"x"}), "wrong fields"),
        (msgpack.packb({"v": 3, "kind": "peer", "body": b"x"}), "format version 3.*upgrade"),
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "limit"),
    ],
)
def test_garbage_or_oversized_record_in_the_store(store, w, payload, match):
    store.set("transport/default/peers/mallory", payload)
    try:
        with pytest.raises(transport.WireFormatError, match=match):
            w.put(torch.ones(16), "mallory", "rw")
        # the garbage does not break listing the others
        assert "recv" in {p.name for p in w.peers()}
    finally:
        store.delete("transport/default/peers/mallory")


def test_record_with_a_wrong_signature_is_rejected(store):
    ns = "signed"
    with transport.Transport("a", store=store, namespace=ns, secret=b"right-secret") as a:
        x = torch.zeros(16)
        a.expose("x", x)
        with transport.Transport("b", store=store, namespace=ns, secret=b"wrong-secret") as b:
            with pytest.raises(transport.SignatureError, match="does not open"):
                b.put(torch.ones(16), "a", "x")
        with transport.Transport("c", store=store, namespace=ns) as c:
            c.expose("x", torch.zeros(16))
            # a Transport without the secret publishes unsealed records; a's side rejects them
            with pytest.raises(transport.SignatureError, match="not sealed"):
                a.put(torch.ones(16), "c", "x")
            # and it is refused by the peer with the secret before any byte moves
            with pytest.raises(transport.SignatureError, match="this Transport has none"):
                c.put(torch.ones(16), "a", "x")
            with pytest.raises(transport.SignatureError, match="this Transport has none"):
                c.notify("a", b"hello")
            assert torch.equal(x, torch.zeros(16))
        with transport.Transport("d", store=store, namespace=ns, secret=b"right-secret") as d:
            d.put(torch.arange(16, dtype=torch.float32), "a", "x").wait(10)
            assert torch.equal(x, torch.arange(16, dtype=torch.float32))


def test_namespaces_do_not_see_each_other(store, receiver):
    with transport.Transport("w2", store=store, namespace="other") as t:
        with pytest.raises(transport.PeerNotFoundError, match="namespace 'other'"):
            t.put(torch.ones(16), "recv", "rw")


def test_exposing_twice_or_empty_is_refused(w):
    w.expose("mine", torch.zeros(8))
    with pytest.raises(ValueError, match="already exposed"):
        w.expose("mine", torch.zeros(8))
    with pytest.raises(ValueError, match="empty"):
        w.expose("empty", torch.zeros(0))
    with pytest.raises(ValueError, match="access must be one of"):
        w.expose("bad-access", torch.zeros(8), access="x")
