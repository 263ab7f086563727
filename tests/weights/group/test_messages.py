"""The weight-sync control messages: every kind round-trips, malformed ones are refused with
WireFormatError (a peer cannot crash a subscriber or a publisher with a message)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import WireFormatError
from transport.weights.group.messages import (
    KINDS,
    MAX_DEGREE,
    Credit,
    Forward,
    Hello,
    Target,
    decode,
    encode,
)
from transport.weights.group.segments import piece, pieces, segments

pytestmark = pytest.mark.unit

GOOD = [
    ("hello", {}),
    ("abort", {"v": 9, "s": 1}),
    ("lend", {"v": 9}),
    ("begin", {"v": 3, "s": 1}),
    ("ver", {"v": 0, "s": 0}),
    ("credit", {"s": [0, 1], "v": -1, "d": -1, "h": []}),
    ("credit", {"s": [0, 1], "v": 6, "d": 6, "h": [6, -1]}),
    ("fwd", {"v": 7, "t": 2500, "to": [["gen-1", 0, 1, -1], ["gen-2", 1, 0, 6]]}),
    ("seg", {"v": 7, "s": 1, "a": 0, "b": 12}),
    ("part", {"v": 7, "s": 1, "a": 3, "o": 32 << 20, "n": 16 << 20}),
    ("patch", {"v": 8, "s": 0, "p": 7, "n": 4096, "a": 0}),
    ("patch", {"v": 8, "s": 1, "p": 6, "n": 4096, "a": 1 << 20}),
    ("patched", {"v": 8, "s": 0, "e": ""}),
    ("patched", {"v": 8, "s": 0, "e": "it holds version 5, not 7"}),
    ("fwdr", {"v": 7, "c": "gen-1", "x": "", "e": "", "n": 0}),
    ("fwdr", {"v": 7, "c": "gen-1", "x": "", "e": "", "n": 4096}),  # landed as changes
    ("fwdr", {"v": 7, "c": "gen-1", "x": "lost", "e": "peer 'gen-1' was lost", "n": 0}),
]


def raw(m):
    return msgpack.packb(m, use_bin_type=True)


@pytest.mark.parametrize("kind, fields", GOOD)
def test_every_kind_round_trips(kind, fields):
    m = decode(raw({"k": kind, **fields}))
    assert type(m) is KINDS[kind]
    assert msgpack.unpackb(encode(m)) == {"k": kind, **fields}  # the wire form is unchanged
    assert decode(encode(m)) == m


def test_messages_are_typed_values_with_named_fields():
    assert set(KINDS) == {k for k, _ in GOOD}
    assert decode(raw({"k": "hello"})) == Hello()
    assert decode(raw({"k": "credit", "s": [1], "v": 4, "d": 5, "h": [4]})) == Credit(
        (1,), 4, 5, (4,)
    )
    assert Credit((0, 1), 4, 4, (4, -1)).held(0) == 4
    assert Credit((0, 1), 4, 4, (4, -1)).held(1) == -1
    assert Credit((1,), 4, 4).held(1) == -1
    fwd = decode(raw({"k": "fwd", "v": 7, "t": 10, "to": [["gen-1", 1, 1, 6]]}))
    assert fwd == Forward(version=7, ms=10, targets=(Target("gen-1", 1, relays=True, base=6),))


BAD = [
    (b"\xc1", "not valid msgpack"),
    (raw([1, 2]), "malformed"),
    (raw({"k": "nope"}), "malformed"),
    (raw({"k": {"a": 1}}), "malformed"),  # found by the minute of fuzzing: an unhashable kind
    (raw({"k": "ver", "v": 1}), "malformed"),  # a field missing
    (raw({"k": "ver", "v": 1, "s": 0, "x": 1}), "malformed"),  # one too many
    (raw({"k": "ver", "v": -1, "s": 0}), "non-negative"),
    (raw({"k": "begin", "v": True, "s": 0}), "non-negative"),
    (raw({"k": "credit", "s": [9], "v": 1, "d": 1, "h": []}), "credit slots"),
    (raw({"k": "credit", "s": [0], "v": "1", "d": 1, "h": []}), "credit versions"),
    (raw({"k": "credit", "s": [0], "v": 1, "d": 1, "h": ["1"]}), "credit versions"),
    (raw({"k": "credit", "s": [0], "v": 1, "d": 1, "h": [1, 1]}), "each credited slot"),
    (raw({"k": "credit", "s": [0], "v": 1, "d": 1}), "malformed"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": []}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0, 0]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["", 0, 0, -1]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 8, 0, -1]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0, 2, -1]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0, True, -1]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0, 0, -2]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": 10, "to": [["gen-1", 0, 0, False]]}), "fwd targets"),
    (raw({"k": "fwd", "v": 1, "t": -5, "to": [["gen-1", 0, 0, -1]]}), "non-negative"),
    (raw({"k": "fwd", "v": 1, "t": 1, "to": [["g", 0, 0, -1]] * (MAX_DEGREE + 1)}), "fwd targets"),
    (raw({"k": "seg", "v": 1, "s": 0, "a": 3, "b": 3}), "at least one tensor"),
    (raw({"k": "seg", "v": 1, "s": 0, "a": -1, "b": 3}), "non-negative"),
    (raw({"k": "part", "v": 1, "s": 0, "a": 1, "o": 0, "n": 0}), "at least one byte"),
    (raw({"k": "abort", "v": 1}), "malformed"),
    (raw({"k": "lend", "v": -3}), "non-negative"),
    (raw({"k": "lend", "v": 3, "s": 0}), "malformed"),
    (raw({"k": "abort", "v": 1, "s": -1}), "non-negative"),
    (raw({"k": "part", "v": 1, "s": 0, "a": 1, "o": -4, "n": 4}), "non-negative"),
    (raw({"k": "part", "v": 1, "s": 0, "a": 1, "o": 0}), "malformed"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "maybe", "e": "", "n": 0}), "relay report"),
    (raw({"k": "fwdr", "v": 1, "c": 5, "x": "", "e": "", "n": 0}), "relay report"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": b"x", "n": 0}), "relay report"),
    (raw({"k": "fwdr", "v": 1, "c": "x" * 300, "x": "", "e": "", "n": 0}), "relay report"),
    (raw({"k": "fwdr", "v": 1, "c": "a/b", "x": "", "e": "", "n": 0}), "relay report"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": ""}), "malformed"),  # no bytes
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": "", "n": -1}), "non-negative"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": "", "n": True}), "non-negative"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": "", "n": "8"}), "non-negative"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "", "e": "", "n": 1 << 63}), "64-bit"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "fail", "e": "x", "n": 8}), "that landed"),
    (raw({"k": "fwdr", "v": 1, "c": "gen-1", "x": "lost", "e": "", "n": 8}), "that landed"),
    (raw({"k": "patch", "v": 8, "s": 0, "p": 8, "n": 10, "a": 0}), "base must be older"),
    (raw({"k": "patch", "v": 8, "s": 0, "p": 3, "n": 0, "a": 0}), "at least one byte"),
    (raw({"k": "patch", "v": 8, "s": 0, "p": -1, "n": 10, "a": 0}), "non-negative"),
    (raw({"k": "patch", "v": 8, "s": 0, "p": 3, "n": 10, "a": -8}), "non-negative"),
    (raw({"k": "patched", "v": 8, "s": 0, "e": 5}), "says why"),
]


@pytest.mark.parametrize("payload, rule", BAD)
def test_malformed_messages_are_refused(payload, rule):
    with pytest.raises(WireFormatError, match=rule):
        decode(payload)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_wire_format_error(payload):
    try:
        m = decode(payload)
    except WireFormatError:
        return
    assert m.KIND in {k for k, _ in GOOD}


_leaf = st.one_of(st.integers(-3, 10), st.text(max_size=8), st.booleans(), st.none())
_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=4), max_leaves=8)


@settings(max_examples=2000, deadline=None)
@given(
    st.sampled_from([k for k, _ in GOOD]),
    st.dictionaries(
        st.sampled_from(["v", "s", "t", "to", "c", "x", "e", "a", "b", "n"]), _value, max_size=5
    ),
)
def test_well_formed_msgpack_of_any_shape_decodes_or_is_refused(kind, fields):
    try:
        m = decode(raw({"k": kind, **fields}))
    except WireFormatError:
        return
    assert kind == m.KIND


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=10),
    st.sampled_from(["uint8", "float16", "float32", "float64"]),
    st.integers(8, 4096),
)
def test_segments_and_pieces_cover_every_byte_once(numels, dtype, seg_bytes):
    """A tensor larger than a segment is a segment of its own, cut into whole-element pieces that
    cover its bytes once, in order; smaller ones are grouped."""
    import torch

    tensors = {
        f"t{i:02d}": torch.zeros(n, dtype=getattr(torch, dtype)) for i, n in enumerate(numels)
    }
    names = sorted(tensors)
    bounds = segments(tensors, seg_bytes)
    assert bounds[0] == 0 and bounds[-1] == len(names) and bounds == sorted(set(bounds))
    for a, b in zip(bounds, bounds[1:], strict=False):
        if any(tensors[n].nbytes > seg_bytes for n in names[a:b]):
            assert b == a + 1  # alone
    for n in names:
        t = tensors[n]
        t.copy_(torch.arange(t.numel()).to(t.dtype))
        cut = pieces(t, seg_bytes)
        assert [o for o, _ in cut] == [sum(k for _, k in cut[:i]) for i in range(len(cut))]
        assert sum(k for _, k in cut) == t.nbytes
        assert all(o % t.element_size() == 0 and k % t.element_size() == 0 for o, k in cut)
        assert all(k <= max(seg_bytes, t.element_size()) for _, k in cut)
        joined = torch.cat([piece(t, o, k) for o, k in cut])
        assert torch.equal(joined, t)
