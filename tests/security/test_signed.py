"""Signed store values: a reader accepts a value only as its writer stored it under its key."""

from __future__ import annotations

import msgpack
import pytest

from transport import SignatureError, WireFormatError
from transport.security import signed
from transport.security.sealing import keys_for
from transport.store.memory import MemoryStore

pytestmark = pytest.mark.unit

KEYS = keys_for(b"secret-123", "ns")
KEY = "transport/ns/groups/g/sub/gen-0"


def test_a_signed_value_reads_back_as_its_writer_wrote_it():
    raw = signed.encode(KEYS, KEY, "gen-0", 7, b"body")
    v = signed.decode(KEYS, KEY, raw, "the entry")
    assert (v.writer, v.generation, v.body, v.raw) == ("gen-0", 7, b"body", raw)
    plain = signed.encode(None, KEY, "gen-0", 7, b"body")
    assert signed.decode(None, KEY, plain, "the entry").body == b"body"


def test_an_outsider_cannot_forge_move_or_alter_a_value():
    raw = signed.encode(KEYS, KEY, "gen-0", 7, b"body")
    with pytest.raises(SignatureError, match="not signed"):  # written without the secret
        signed.decode(KEYS, KEY, signed.encode(None, KEY, "gen-0", 7, b"evil"), "the entry")
    with pytest.raises(SignatureError, match="valid MAC"):  # moved to another key
        signed.decode(KEYS, KEY.replace("gen-0", "gen-1"), raw, "the entry")
    with pytest.raises(SignatureError, match="valid MAC"):  # another namespace's secret
        signed.decode(keys_for(b"secret-123", "other"), KEY, raw, "the entry")
    m = msgpack.unpackb(raw)
    for field, value in (("body", b"evil"), ("writer", "gen-1"), ("gen", 8)):
        forged = msgpack.packb({**m, field: value}, use_bin_type=True)
        with pytest.raises(SignatureError, match="valid MAC"):
            signed.decode(KEYS, KEY, forged, "the entry")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 1}),
        msgpack.packb({"v": 2, "kind": "signed", "writer": "a", "gen": 1, "body": b"", "mac": b""}),
        msgpack.packb(
            {"v": 1, "kind": "signed", "writer": "a\n", "gen": 1, "body": b"", "mac": b""}
        ),
        msgpack.packb({"v": 1, "kind": "signed", "writer": "a", "gen": 0, "body": b"", "mac": b""}),
        msgpack.packb(
            {"v": 1, "kind": "signed", "writer": "a", "gen": True, "body": b"", "mac": b""}
        ),
        msgpack.packb({"v": 1, "kind": "signed", "writer": "a", "gen": 1, "body": "s", "mac": b""}),
    ],
)
def test_malformed_envelopes_are_refused_by_name(raw):
    with pytest.raises(WireFormatError):
        signed.decode(None, KEY, raw, "the entry")


def test_read_ignores_what_it_cannot_trust_and_says_why(caplog):
    store = MemoryStore()
    ours = signed.SignedStore(store, KEYS, "gen-0", 3)
    theirs = signed.SignedStore(store, None, "gen-0", 3)  # no secret: an outsider
    ours.set(KEY, b"good")
    assert ours.read(KEY, "the entry", writer="gen-0").body == b"good"
    assert ours.read(KEY, "the entry", writer="gen-1") is None  # another peer's key
    theirs.set(KEY, b"evil")
    assert ours.read(KEY, "the entry", writer="gen-0") is None
    assert "not signed" in caplog.text
    assert ours.read("transport/ns/missing", "x") is None
    raw = ours.set(KEY, b"v1")
    assert ours.compare_set(KEY, raw, b"v2")
    assert not ours.compare_set(KEY, raw, b"v3")
    assert ours.get(KEY, "the entry").body == b"v2"
