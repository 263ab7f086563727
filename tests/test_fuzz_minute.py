"""A minute of fuzzing of every decoder that reads bytes from other processes: peer records,
heartbeats, notification frames and weight-sync messages. Inputs are valid encodings mutated
(bit flips, truncations, splices, repeated and inserted bytes, msgpack values swapped) and plain
random bytes. The only exception allowed is WireFormatError (SignatureError with a secret); a
hang would hold the test up to its timeout. The slowest input is printed, not asserted (a loaded
machine makes any input slow).

TRANSPORT_FUZZ_SECONDS sets the duration: 10 s by default (the test suite), 60 for the full
minute (``TRANSPORT_FUZZ_SECONDS=60 bash tests/run.sh -m slow -k fuzz``); the inputs per minute
are printed."""

from __future__ import annotations

import os
import random
import time

import msgpack
import pytest

from transport import RegionInfo, WireFormatError
from transport.weights.group.messages import (
    Abort,
    Credit,
    Forward,
    PartLanded,
    Report,
    Segment,
    Target,
    Ver,
)
from transport.weights.group.messages import decode as decode_ws
from transport.weights.group.messages import encode as encode_ws
from transport.wire import (
    PeerRecord,
    decode_heartbeat,
    decode_peer_record,
    encode_heartbeat,
    encode_peer_record,
    frame_control,
    frame_user_notification,
    parse_notification,
)

pytestmark = pytest.mark.unit

SECONDS = float(os.environ.get("TRANSPORT_FUZZ_SECONDS", "10"))
SECRET = b"fuzz-secret-123"


def _seeds() -> list[tuple[str, bytes]]:
    regions = tuple(
        RegionInfo(
            f"layers.{i}.w", 0x7F0000000000 + i * 8192, 4096, "float32", (32, 32), "rw", "cpu"
        )
        for i in range(6)
    )
    rec = PeerRecord(
        name="gen-0",
        namespace="ns",
        generation=7,
        agent="gen-0#7",
        backend="nixl",
        metadata=bytes(range(256)) * 4,
        host="h",
        pid=1234,
        version="0.1.0",
        created=1.0,
        regions=regions,
        registrations=((0x7F0000000000, 6 * 8192, "cpu"),),
    )
    return [
        ("record", encode_peer_record(rec)),
        ("record-signed", encode_peer_record(rec, SECRET)),
        ("heartbeat", encode_heartbeat(7, 12345.5)),
        ("frame", frame_control("ws/policy", encode_ws(Ver(3, 1)))),
        ("frame", frame_user_notification(b"hello")),
        ("ws", encode_ws(Forward(9, 1000, (Target("gen-1", 0, True), Target("gen-2", 1, False))))),
        ("ws", encode_ws(Credit((0, 1), 4))),
        ("ws", encode_ws(Report(9, "gen-1", "fail", "why"))),
        ("ws", encode_ws(Segment(9, 0, 2, 5))),
        ("ws", encode_ws(PartLanded(9, 0, 2, 4096, 8192))),
        ("ws", encode_ws(Abort(9, 1))),
    ]


def _decode(kind: str, data: bytes) -> None:
    if kind == "record":
        decode_peer_record(data, None, "ns")
    elif kind == "record-signed":
        decode_peer_record(data, SECRET, "ns")
    elif kind == "heartbeat":
        decode_heartbeat(data)
    elif kind == "frame":
        tag, channel, payload = parse_notification(data)
        if channel.startswith("ws/"):
            decode_ws(payload)
    else:
        decode_ws(data)


def _mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and b:  # flip bits
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)) :]
        elif op == 2:  # insert random bytes
            i = rng.randint(0, len(b))
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and b:  # set an interesting byte (msgpack type markers, limits)
            b[rng.randrange(len(b))] = rng.choice(
                [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]
            )
        elif op == 4 and len(b) > 2:  # repeat a slice
            i = rng.randrange(len(b) - 1)
            j = rng.randint(i + 1, min(len(b), i + 64))
            b[j:j] = b[i:j] * rng.randint(1, 8)
        elif op == 5:  # splice with another seed
            o = rng.choice(others)
            i, j = rng.randint(0, len(b)), rng.randint(0, len(o))
            b = b[:i] + bytearray(o[j:])
        elif op == 6:  # a structured change: decode the msgpack and replace one value
            try:
                m = msgpack.unpackb(bytes(b), raw=False)
            except Exception:
                continue
            if isinstance(m, dict) and m:
                k = rng.choice(list(m))
                m[k] = rng.choice([None, -1, 2**64 - 1, "", "x" * 300, [], {}, 1.5, True, b"\0"])
                b = bytearray(msgpack.packb(m, use_bin_type=True))
        else:  # random bytes
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(b)


@pytest.mark.slow
def test_a_minute_of_fuzzing_raises_only_wire_format_error():
    rng = random.Random(int(os.environ.get("TRANSPORT_FUZZ_SEED", "1234")))
    seeds = _seeds()
    for kind, data in seeds:
        _decode(kind, data)  # every seed is valid to begin with
    others = [d for _, d in seeds]
    count, slowest, rejected = 0, 0.0, 0
    end = time.monotonic() + SECONDS
    while time.monotonic() < end:
        for _ in range(200):
            kind, data = rng.choice(seeds)
            fuzzed = _mutate(rng, data, others)
            t0 = time.perf_counter()
            try:
                _decode(kind, fuzzed)
            except WireFormatError:  # SignatureError is one
                rejected += 1
            slowest = max(slowest, time.perf_counter() - t0)
            count += 1
    per_minute = count * 60 / SECONDS
    print(
        f"\nfuzz: {count} inputs in {SECONDS:.0f} s ({per_minute:,.0f} per minute), "
        f"{rejected} rejected, slowest {slowest * 1e3:.2f} ms"
    )
    assert rejected > count // 2  # the mutations do reach the checks
