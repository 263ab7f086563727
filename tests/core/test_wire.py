"""Peer records: round trip, strict validation, signatures, garbage."""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.records import record
from transport import RegionInfo, SignatureError, WireFormatError
from transport.memory.region_codec import MAX_MAP_BYTES
from transport.wire import (
    FORMAT_VERSION,
    MAX_RECORD_BYTES,
    MAX_REGIONS,
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

pytestmark = pytest.mark.unit


def body_of(raw: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(raw)["body"])


def memory_of(body: dict) -> dict:
    """The columns of a record body's memory map."""
    return msgpack.unpackb(zlib.decompress(body["memory"]))


def with_memory(body: dict, mutate) -> dict:
    """``body`` with its memory map changed by ``mutate`` (of the columns)."""
    m = memory_of(body)
    mutate(m)
    return dict(body, memory=zlib.compress(msgpack.packb(m, use_bin_type=True)))


def rewrap(body: dict, **env) -> bytes:
    e = {
        "v": FORMAT_VERSION,
        "kind": "peer",
        "body": msgpack.packb(body, use_bin_type=True),
        "sealed": False,
    }
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
    # the same record without a secret: in the clear (compressed)
    assert zlib.decompress(body_of(encode_peer_record(rec))["md"]) == md
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
        (lambda b: b.update(md=zlib.compress(b"")), "metadata is empty"),
        (lambda b: b.update(md=zlib.compress(b"\0" * (64 << 20 | 1))), "metadata .*inflates past"),
        (lambda b: b.pop("memory"), "missing \\['memory'\\]"),
        (lambda b: b.update(memory=b"not zlib"), "not valid zlib"),
        (lambda b: b.update(memory=zlib.compress(b"\xc1")), "not valid msgpack"),
        (lambda b: b.update(memory=zlib.compress(msgpack.packb({"ra": []}))), "must be a map of"),
        (lambda b: b.update(memory=b["memory"][:-3]), "truncated|zlib"),
    ],
)
def test_malformed_bodies_are_rejected(mutate, match):
    body = body_of(encode_peer_record(record()))
    mutate(body)
    with pytest.raises(WireFormatError, match=match):
        decode_peer_record(rewrap(body))


_WIDTH = {"ra": "<u8", "rn": "<u8", "reg": "<u4", "off": "<u8", "dims": "<u8"}


def _set(col, i, v):
    """Entry ``i`` of column ``col``: a packed number of the numeric columns, a list's item else."""
    if col not in _WIDTH:
        return lambda m: m[col].__setitem__(i, v)

    def mutate(m):
        a = np.frombuffer(m[col], _WIDTH[col]).copy()
        a[i] = v
        m[col] = a.tobytes()

    return mutate


@pytest.mark.parametrize(
    "mutate, match",
    [
        # a region's place: an offset into a registration of its peer, inside it
        (_set("off", 0, 4096 - 32), "outside the memory its peer registered"),
        (_set("off", 0, 2**56), "bad offset"),
        (lambda m: m.update(off=[0, 0]), "must be bytes of packed"),
        (_set("reg", 0, 2), "names no registration"),
        (_set("dims", 0, 2**40), "outside the memory|too large"),
        (_set("dims", 0, 2**63), "bad shape dimension"),
        (lambda m: m.update(dims=m["dims"][:-1]), "wrong number of dimensions"),
        (lambda m: m.update(nd=bytes([17, 1])), "bad shape|wrong number"),
        (lambda m: m.update(dt=bytes([250, 0])), "unknown dtype"),
        (lambda m: m.update(acc=bytes([9, 0])), "unknown access"),
        (lambda m: m.update(off=m["off"][:1]), "unequal length"),
        (lambda m: m.update(names=["x", "x"]), "twice"),
        (lambda m: m.update(names=["", "x"]), "bad name"),
        (lambda m: m.update(names=["x" * 1025, "y"]), "bad name"),
        (lambda m: m.update(names=[7, "y"]), "bad name"),
        # registrations
        (lambda m: m.update(ra=b"", rn=b"", rd=[]), "names no registration"),
        (_set("rn", 0, 0), "malformed registration"),
        (_set("ra", 0, 0), "malformed registration"),
        (_set("rd", 0, "tpu"), "malformed registration"),
        (_set("rn", 0, 2**56 + 1), "malformed registration"),
        (lambda m: m.update(ra="a"), "must be bytes of packed"),
        (_set("ra", 0, 2**64 - 8), "malformed registration"),
        (lambda m: m.update(rd=["cpu"]), "unequal length"),
    ],
)
def test_malformed_memory_maps_are_rejected(mutate, match):
    body = with_memory(body_of(encode_peer_record(record())), mutate)
    with pytest.raises(WireFormatError, match=match):
        decode_peer_record(rewrap(body))


def test_a_map_that_inflates_past_its_bound_is_refused_unread():
    bomb = zlib.compress(b"\x00" * (MAX_MAP_BYTES + 1), 9)
    assert len(bomb) < 1 << 20  # small on the wire
    body = dict(body_of(encode_peer_record(record())), memory=bomb)
    with pytest.raises(WireFormatError, match="inflates past"):
        decode_peer_record(rewrap(body))


def test_a_region_is_placed_by_its_registration_whatever_the_writer_claims():
    """A region of cuda:1 whose registration index is changed to the cpu one takes that
    registration's address and device: no decoded region lies outside registered memory."""
    body = with_memory(body_of(encode_peer_record(record())), _set("reg", 1, 0))
    rec = decode_peer_record(rewrap(body))
    emb = rec.region_map()["emb"]
    assert emb.device == "cpu" and emb.addr == 0x7F0000001000


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
    body = with_memory(
        body_of(encode_peer_record(record())),
        lambda m: m.update(
            names=[f"r{i}" for i in range(MAX_REGIONS + 1)],
            reg=[0] * (MAX_REGIONS + 1),
            off=[0] * (MAX_REGIONS + 1),
            dt=bytes(MAX_REGIONS + 1),
            acc=bytes(MAX_REGIONS + 1),
            nd=bytes(MAX_REGIONS + 1),
            dims=[],
        ),
    )
    with pytest.raises(WireFormatError, match="more than"):
        decode_peer_record(rewrap(body))


def test_a_record_of_200000_regions_fits_the_store_and_round_trips():
    """A mixture-of-experts subscriber: 100,000 names in two staging slots of one buffer each."""
    names = [f"model.layers.{i // 384}.mlp.experts.{i // 3 % 128}.w{i % 3}" for i in range(100_000)]
    base, regions = 0x7F0000000000, []
    for slot in range(2):
        for i, n in enumerate(names):
            addr = base + (slot * 100_000 + i) * 640
            regions.append(RegionInfo(f"s{slot}/{n}", addr, 640, "bfloat16", (16, 20), "w", "cpu"))
    rec = record(regions=tuple(regions), registrations=((base, 200_000 * 640, "cpu"),))
    raw = encode_peer_record(rec, b"k" * 16)
    assert len(raw) < MAX_RECORD_BYTES // 4
    assert decode_peer_record(raw, b"k" * 16, "run-7") == rec


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
        {
            "v": FORMAT_VERSION,
            "kind": "peer",
            "body": msgpack.packb(obj, use_bin_type=True),
            "sealed": False,
        }
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


_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.binary(max_size=6)
    | st.text(max_size=6)
)
_COLUMNS = ("ra", "rn", "rd", "names", "reg", "off", "dt", "acc", "nd", "dims")


@settings(max_examples=500, deadline=None, derandomize=True)
@given(
    st.dictionaries(st.sampled_from(_COLUMNS), st.lists(_LEAF, max_size=4) | _LEAF), st.booleans()
)
def test_any_memory_map_columns_decode_or_raise_wire_format_error(columns, on_a_valid_map):
    """A peer's memory map with any column replaced by anything msgpack carries: decoded, or
    refused with WireFormatError (never another exception from the column checks)."""
    body = body_of(encode_peer_record(record()))
    m = memory_of(body) if on_a_valid_map else {}
    m.update(columns)
    body["memory"] = zlib.compress(msgpack.packb(m, use_bin_type=True))
    try:
        decode_peer_record(rewrap(body))
    except WireFormatError:
        pass
