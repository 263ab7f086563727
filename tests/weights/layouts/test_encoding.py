"""A subscriber's declared layout as the store holds it: every layout survives the trip, a
peer's malformed bytes are refused with the rule, and the source digest tells layouts apart."""

from __future__ import annotations

import msgpack
import pytest
import torch

from transport import WireFormatError
from transport.weights import DestTensor, Piece, Slice, SourceLayout, fp8, full_copy, tp_shard
from transport.weights.layouts.encoding import (
    decode_dest,
    decode_sources,
    encode_dest,
    source_digest,
)

pytestmark = pytest.mark.unit

SRC = SourceLayout.split(
    2,
    {"q": ((64, 32), torch.float32), "k": ((32, 32), torch.float32), "n": ((32,), torch.float32)},
    {"n": None},
)


def test_layouts_survive_the_trip():
    lay = {"qk": tp_shard(SRC, "qk", ["q", "k"], 0, 2, 1), **full_copy(SRC, ["n"], {"n2": "n"})}
    lay |= fp8(full_copy(SRC, ["q"]), block=(16, 16))
    assert decode_dest(encode_dest(lay)) == lay


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"v": 2, "t": {}}, "'v': 1"),
        ({"v": 1, "t": {}}, "at least one tensor"),
        ({"v": 1, "t": {"x": [[4], "float32", 0, []]}}, "expected \\[shape"),
        ({"v": 1, "t": {"x": [[4], "complex", 0, [], None, ""]}}, "malformed shape"),
        ({"v": 1, "t": {"x": [[4], "float32", 3, [], None, ""]}}, "malformed shape"),
        (
            {"v": 1, "t": {"x": [[4], "float32", 0, [["q", 9, 0, 1, 0]], None, ""]}},
            "malformed piece",
        ),
        (
            {"v": 1, "t": {"x": [[4], "float32", 0, [["q", None, -1, 1, 0]], None, ""]}},
            "malformed piece",
        ),
        (
            {"v": 1, "t": {"x": [[4], "float32", 0, [["q", None, 0, 0, 0]], ["s", [0, 4]], ""]}},
            "quant",
        ),
        ({"v": 1, "t": {"": [[4], "float32", 0, [], None, ""]}}, "short str"),
    ],
)
def test_malformed_layouts_are_refused_with_the_rule(doc, message):
    with pytest.raises(WireFormatError, match=message):
        decode_dest(msgpack.packb(doc))


def test_garbage_and_oversized_layouts_are_refused():
    with pytest.raises(WireFormatError):
        decode_dest(b"\xc1\x00garbage")
    with pytest.raises(WireFormatError):
        decode_dest(encode_dest(full_copy(SRC)), limit=16)


def test_the_digest_tells_source_layouts_apart():
    same = SourceLayout.split(
        2, {n: (t.shape, t.dtype) for n, t in SRC.tensors.items()}, {"n": None}
    )
    assert source_digest(same) == source_digest(SRC)
    other = SourceLayout.split(2, {n: (t.shape, t.dtype) for n, t in SRC.tensors.items()}, {"n": 0})
    assert source_digest(other) != source_digest(SRC)


@pytest.mark.parametrize(
    "sources",
    [{"q": "big"}, {"q": [-1, 4]}, {"q": []}, {"q": [1] * 9}, {"": [4]}, ["q", 4]],
)
def test_malformed_source_shapes_are_refused_with_the_rule(sources):
    raw = msgpack.packb({"v": 1, "t": {}, "s": sources}, use_bin_type=True)
    with pytest.raises(WireFormatError):
        decode_sources(raw)


def test_source_shapes_travel_with_the_layout():
    layout = {"q": DestTensor((2, 4), torch.float32, (Piece("q", Slice(0, 0, 2)),))}
    raw = encode_dest(layout, {"q": (4, 4)})
    assert decode_dest(raw) == layout and decode_sources(raw) == {"q": (4, 4)}
    assert decode_sources(encode_dest(layout)) == {}
