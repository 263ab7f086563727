"""The one codec of weight sync's control messages: both protocols (the weight groups', the
bucket stream's) put their kind under "k" and are checked by the same rules, and a message class
that does not declare a key for each field is refused when its codec is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import msgpack
import pytest

from transport import WireFormatError
from transport.weights.buckets import messages as buckets
from transport.weights.group import messages as group
from transport.weights.message_codec import KIND_KEY, Codec

pytestmark = pytest.mark.unit

TOKEN = "00ff00ff00ff00ff"


@dataclass(frozen=True)
class Ping:
    KIND: ClassVar[str] = "ping"
    WIRE: ClassVar[dict[str, str]] = {"count": "c", "loud": "l", "note": "n"}
    count: int
    loud: bool
    note: str


PINGS: Codec[Ping] = Codec("ping", (Ping,), max_bytes=256, max_str=64, max_array=0, max_map=8)


@pytest.mark.parametrize(
    "codec, msg",
    [
        (group.CODEC, group.Credit((0, 1), 5, 5, (5, -1))),
        (group.CODEC, group.Forward(3, 100, (group.Target("gen-1", 1, True, 2),))),
        (group.CODEC, group.Patch(4, 1, 3, 4096)),
        (buckets.CODEC, buckets.Bucket(TOKEN, 3, 1, 100, 128, 40, False, 0)),
        (buckets.CODEC, buckets.Free(TOKEN, 9)),
        (buckets.CODEC, buckets.Stop(TOKEN, "rank 1 is gone", True)),
        (PINGS, Ping(3, False, "hi")),
    ],
)
def test_each_protocol_puts_its_kind_under_one_key_and_round_trips(codec, msg):
    wire = msgpack.unpackb(codec.encode(msg))
    assert wire[KIND_KEY] == msg.KIND
    assert set(wire) == {KIND_KEY, *msg.WIRE.values()}
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    "fields, rule",
    [
        (
            {"c": True, "l": False, "n": ""},
            "'c' of a 'ping' message must be a non-negative 64-bit int",
        ),
        ({"c": -1, "l": False, "n": ""}, "non-negative 64-bit int"),
        ({"c": 1, "l": 1, "n": ""}, "'l' of a 'ping' message must be a bool"),
        ({"c": 1, "l": True, "n": b"x"}, "'n' of a 'ping' message must be a str"),
        ({"c": 1, "l": True}, "malformed ping message"),
        ({"c": 1, "l": True, "n": "", "x": 0}, "malformed ping message"),
    ],
)
def test_fields_are_checked_by_their_annotation(fields, rule):
    payload = msgpack.packb({KIND_KEY: "ping", **fields}, use_bin_type=True)
    with pytest.raises(WireFormatError, match=rule):
        PINGS.decode(payload)
    assert PINGS.decode_from("peer-1", payload) is None  # dropped, never raised at a handler


def test_a_message_of_one_protocol_is_garbage_to_the_other():
    with pytest.raises(WireFormatError, match="malformed"):
        group.decode(buckets.encode(buckets.Stop(TOKEN, "why", False)))
    with pytest.raises(WireFormatError, match="malformed"):
        buckets.decode(group.encode(group.Abort(3, 1)))


def test_a_class_without_a_key_for_each_field_is_refused_when_its_codec_is_made():
    @dataclass(frozen=True)
    class Half:
        KIND: ClassVar[str] = "half"
        WIRE: ClassVar[dict[str, str]] = {"a": "a"}
        a: int
        b: int

    with pytest.raises(TypeError, match="must give a key to each field"):
        Codec("half", (Half,), max_bytes=64, max_str=8, max_array=0, max_map=4)
