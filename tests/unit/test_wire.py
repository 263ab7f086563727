"""Peer records: round trip, strict validation, signatures, garbage."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.errors import SignatureError, WireFormatError
from transport.wire import (
    MAX_REGIONS,
    PeerRecord,
    RegionInfo,
    agent_name,
    check_name,
    decode_heartbeat,
    decode_peer_record,
    encode_heartbeat,
    encode_peer_record,
    frame_control,
    frame_user_notification,
    parse_notification,
    peer_of_agent,
)


def record(**over) -> PeerRecord:
    base = dict(
        name="gen-0", namespace="run-7", generation=3, agent="gen-0#3", backend="nixl", metadata=b"md" * 50,
        host="h", pid=42, version="0.1.0", created=1.5,
        regions=(RegionInfo("layers.0.w", 0x7F0000001000, 64, "float32", (4, 4), "rw", "cpu"),
                 RegionInfo("emb", 0x7F0000002000, 2, "bfloat16", (1,), "r", "cuda:1")),
        registrations=((0x7F0000001000, 4096, "cpu"), (0x7F0000002000, 2, "cuda:1")),
    )  # fmt: skip
    base.update(over)
    return PeerRecord(**base)


def body_of(raw: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(raw)["body"])


def rewrap(body: dict, **env) -> bytes:
    e = {"v": 3, "kind": "peer", "body": msgpack.packb(body, use_bin_type=True), "sealed": False}
    e.update(env)
    return msgpack.packb(e, use_bin_type=True)


def test_round_trip_with_and_without_secret():
    rec = record()
    assert decode_peer_record(encode_peer_record(rec)) == rec
    assert decode_peer_record(encode_peer_record(rec, b"k" * 16), b"k" * 16, "run-7") == rec


def test_sealing_rules():
    sealed = encode_peer_record(record(), b"secret-1")
    with pytest.raises(SignatureError, match="does not open with the shared secret"):
        decode_peer_record(sealed, b"secret-2", "run-7")
    with pytest.raises(SignatureError, match="does not open"):  # the key is the namespace's too
        decode_peer_record(sealed, b"secret-1", "run-8")
    with pytest.raises(SignatureError, match="not sealed"):
        decode_peer_record(encode_peer_record(record()), b"secret-1", "run-7")
    with pytest.raises(SignatureError, match="Transport has none"):
        decode_peer_record(sealed)
    # one bit changed anywhere in the sealed body and it no longer opens
    env = msgpack.unpackb(sealed)
    for i in (0, 20, len(env["body"]) - 1):
        body = bytearray(env["body"])
        body[i] ^= 1
        env2 = dict(env, body=bytes(body))
        with pytest.raises(SignatureError):
            decode_peer_record(msgpack.packb(env2, use_bin_type=True), b"secret-1", "run-7")


def test_a_sealed_record_shows_nothing_of_its_connection_metadata_or_memory():
    md = bytes(range(256)) * 4
    rec = record(metadata=md)
    sealed = encode_peer_record(rec, b"secret-1")
    assert md[:64] not in sealed and b"layers.0.w" not in sealed and b"gen-0#3" not in sealed
    assert md[:64] in encode_peer_record(rec)  # the same record without a secret: in the clear
    assert decode_peer_record(sealed, b"secret-1", "run-7").metadata == md


def test_namespace_is_checked():
    with pytest.raises(WireFormatError, match="namespace 'run-7', not 'other'"):
        decode_peer_record(encode_peer_record(record()), None, "other")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.pop("pid"), "missing \\['pid'\\]"),
        (lambda b: b.update(extra=1), "unexpected \\['extra'\\]"),
        (lambda b: b.update(gen="3"), "'gen' must be int"),
        (lambda b: b.update(gen=True), "'gen' must be int"),
        (lambda b: b.update(gen=0), "out-of-range"),
        (lambda b: b.update(name="a/b"), "invalid name"),
        (lambda b: b.update(md=b""), "metadata"),
        (
            lambda b: b.update(regions=[["x", 4096, 12, "float32", [4], "rw", "cpu"]]),
            "does not match nbytes",
        ),
        (lambda b: b.update(regions=[["x", 0, 4, "float32", [1], "rw", "cpu"]]), "outside memory"),
        (
            lambda b: b.update(regions=[["x", 2**64 - 2, 4, "float32", [1], "rw", "cpu"]]),
            "outside memory",
        ),
        (
            lambda b: b.update(regions=[["x", 4096, 4, "float31", [1], "rw", "cpu"]]),
            "unknown dtype",
        ),
        (
            lambda b: b.update(regions=[["x", 4096, 4, "float32", [1], "x", "cpu"]]),
            "unknown access",
        ),
        (
            lambda b: b.update(regions=[["x", 4096, 4, "float32", [1], "rw", "tpu:0"]]),
            "unknown device",
        ),
        (lambda b: b.update(regions=[["x", 4096, 4, "float32", [1], "rw"]]), "7 fields"),
        (lambda b: b.update(regions=[["x", 4096, 4, "float32", [1], "rw", "cpu"]] * 2), "twice"),
        (lambda b: b.update(regions=[["x", 4096, -4, "float32", [-1], "rw", "cpu"]]), "bad nbytes"),
        # regions must lie in registered memory of their device
        (
            lambda b: b["regions"][0].__setitem__(1, 0x7F0000001000 + 4096 - 32),
            "outside the memory its peer registered",
        ),
        (lambda b: b["regions"][0].__setitem__(1, 0x7F0000000FF0), "outside the memory"),
        (lambda b: b["regions"][1].__setitem__(6, "cuda:0"), "outside the memory"),
        (lambda b: b.update(regs=[]), "outside the memory"),
        (lambda b: b.update(regs=[[0x1000, 0, "cpu"]]), "malformed registration"),
        (lambda b: b.update(regs=[[0x1000, 8, "tpu"]]), "malformed registration"),
        (lambda b: b.update(regs=[[0x1000, True, "cpu"]]), "malformed registration"),
        (lambda b: b.update(regs=[["a", 8, "cpu"]]), "malformed registration"),
        (lambda b: b.pop("regs"), "missing \\['regs'\\]"),
    ],
)
def test_malformed_bodies_are_rejected(mutate, match):
    body = body_of(encode_peer_record(record()))
    mutate(body)
    with pytest.raises(WireFormatError, match=match):
        decode_peer_record(rewrap(body))


def test_envelope_rules():
    body = body_of(encode_peer_record(record()))
    with pytest.raises(WireFormatError, match="format version 1"):
        decode_peer_record(rewrap(body, v=1))
    with pytest.raises(WireFormatError, match="not a peer record"):
        decode_peer_record(rewrap(body, kind="other"))
    with pytest.raises(WireFormatError, match="'sealed' must be bool"):
        decode_peer_record(rewrap(body, sealed=b"short"))
    with pytest.raises(WireFormatError, match="must be bytes"):
        decode_peer_record("text")  # type: ignore[arg-type]


def test_too_many_regions_is_refused_when_encoding_and_decoding():
    many = tuple(
        RegionInfo(f"r{i}", 4096 * (i + 1), 4, "float32", (1,), "rw", "cpu")
        for i in range(MAX_REGIONS + 1)
    )
    with pytest.raises(ValueError, match="over the .* limit|expose fewer"):
        encode_peer_record(record(regions=many))
    body = body_of(encode_peer_record(record()))
    body["regions"] = [["x", 4096, 4, "float32", [1], "rw", "cpu"]] * (MAX_REGIONS + 1)
    with pytest.raises(WireFormatError):
        decode_peer_record(rewrap(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_only_raises_wire_format_error(data):
    with pytest.raises(WireFormatError):
        decode_peer_record(data)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.binary(max_size=8)
        | st.text(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=5),
        max_leaves=20,
    )
)
def test_well_formed_msgpack_of_the_wrong_shape_only_raises_wire_format_error(obj):
    raw = msgpack.packb(
        {"v": 3, "kind": "peer", "body": msgpack.packb(obj, use_bin_type=True), "sealed": False}
    )
    with pytest.raises(WireFormatError):
        decode_peer_record(raw)


def test_heartbeats_and_frames():
    assert decode_heartbeat(encode_heartbeat(5, 12.5)) == (5, 12.5)
    with pytest.raises(WireFormatError):
        decode_heartbeat(b"\x93\x01\x02\x03")
    assert parse_notification(frame_user_notification(b"v7")) == (0x75, "", b"v7")
    assert parse_notification(frame_control("sync", b"\x01")) == (0x63, "sync", b"\x01")
    for bad in (b"c", b"c\x05ab", b"c\x00", b"c\x02\xff\xfe"):
        with pytest.raises(WireFormatError):
            parse_notification(bad)
    with pytest.raises(WireFormatError, match="unknown tag"):
        parse_notification(b"\x01abc")
    with pytest.raises(WireFormatError, match="empty"):
        parse_notification(b"")
    with pytest.raises(ValueError, match="limit"):
        frame_user_notification(b"x" * (64 << 10 + 1))


def test_names():
    assert peer_of_agent(agent_name("trainer-0", 12)) == ("trainer-0", 12)
    assert peer_of_agent("no-generation") is None
    assert check_name("peer name", "gen.0:a-b_c") == "gen.0:a-b_c"
    for bad in ["", "-x", "a/b", "a#1", "x" * 129, "a b"]:
        with pytest.raises(ValueError, match="not allowed"):
            check_name("peer name", bad)
    with pytest.raises(TypeError):
        check_name("peer name", 3)
