"""The memory map's bounds, from the side of a peer that writes its own record: a map of 64 KiB
that an older reader inflated into gigabytes of Python lists is refused before it is built; numbers
travel packed, and every column's length is checked before a number is read; device names are
ASCII patterns. The assertions are about the reader: the error, and its peak memory."""

from __future__ import annotations

import time
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from helpers.records import record
from transport import RegionInfo, WireFormatError
from transport.memory.region_codec import MAX_REGIONS, device_ok
from transport.wire import (
    DTYPE_SIZES,
    FORMAT_VERSION,
    MAX_DIMS,
    decode_peer_record,
    encode_peer_record,
)

pytestmark = pytest.mark.unit

MiB = 1 << 20
#: the widths the numeric columns travel in
WIDTH = {"ra": "<u8", "rn": "<u8", "reg": "<u4", "off": "<u8", "dims": "<u8"}


def body() -> dict[str, Any]:
    """The body of an honest record, as its writer's store holds it."""
    return msgpack.unpackb(msgpack.unpackb(encode_peer_record(record()))["body"])


def stored(memory: bytes) -> bytes:
    """What a peer puts in the store: an honest record but for its memory map."""
    b = dict(body(), memory=memory)
    env = {"v": FORMAT_VERSION, "kind": "peer", "body": msgpack.packb(b), "sealed": False}
    return msgpack.packb(env, use_bin_type=True)


def columns() -> dict[str, Any]:
    return msgpack.unpackb(zlib.decompress(body()["memory"]))


def with_columns(mutate: Callable[[dict[str, Any]], None]) -> bytes:
    m = columns()
    mutate(m)
    return stored(zlib.compress(msgpack.packb(m, use_bin_type=True)))


def poke(col: str, i: int, value: int) -> Callable[[dict[str, Any]], None]:
    """Set number ``i`` of the packed column ``col``."""

    def mutate(m: dict[str, Any]) -> None:
        a = np.frombuffer(m[col], WIDTH[col]).copy()
        a[i] = value
        m[col] = a.tobytes()

    return mutate


def cut(col: str, keep: slice) -> Callable[[dict[str, Any]], None]:
    return lambda m: m.update({col: m[col][keep]})


def as_list(col: str) -> Callable[[dict[str, Any]], None]:
    """The column as an older writer wrote it: a msgpack list of its numbers."""
    return lambda m: m.update({col: np.frombuffer(m[col], WIDTH[col]).tolist()})


# --- hostile maps of 64 KiB ----------------------------------------------------------------------
# Each is raw msgpack the attacker compresses; the older reader allowed arrays of
# MAX_REGIONS * MAX_DIMS (16M) entries in every column and built every one as a Python list.

_OLD_LIMIT = MAX_REGIONS * MAX_DIMS


def _key(k: str) -> bytes:
    return msgpack.packb(k)


def _array_header(n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big")


def _empty_bin() -> bytes:
    return msgpack.packb(b"", use_bin_type=True)


def long_lists() -> bytes:
    """16M names of two characters and 16M zero dimensions, as lists: the older reader built
    1.2 GiB of objects before it counted the regions."""
    out = bytearray(b"\x8a")
    for k in ("ra", "rn"):
        out += _key(k) + _empty_bin()
    out += _key("rd") + b"\x90"
    out += _key("names") + _array_header(_OLD_LIMIT) + b"\xa2ab" * _OLD_LIMIT
    for k in ("reg", "off", "dt", "acc", "nd"):
        out += _key(k) + _empty_bin()
    out += _key("dims") + _array_header(_OLD_LIMIT) + b"\x00" * _OLD_LIMIT
    return bytes(out)


def nested_lists() -> bytes:
    """names: 64 lists of a million empty lists each, one byte apiece: 4.5 GiB to the older
    reader (each list header within its limits)."""
    out = bytearray(b"\x8a")
    for k in ("ra", "rn"):
        out += _key(k) + _empty_bin()
    out += _key("rd") + b"\x90"
    out += (
        _key("names")
        + _array_header(64)
        + (_array_header(MAX_REGIONS) + b"\x90" * MAX_REGIONS) * 64
    )
    for k in ("reg", "off", "dt", "acc", "nd", "dims"):
        out += _key(k) + _empty_bin()
    return bytes(out)


def nested_maps() -> bytes:
    """names: 64 lists of a million empty maps each (older reader: a dict each)."""
    out = bytearray(b"\x8a")
    out += (
        _key("names")
        + _array_header(64)
        + (_array_header(MAX_REGIONS) + b"\x80" * MAX_REGIONS) * 64
    )
    for k in ("ra", "rn", "reg", "off", "dt", "acc", "nd", "dims"):
        out += _key(k) + _empty_bin()
    out += _key("rd") + b"\x90"
    return bytes(out)


def numeric_lists() -> bytes:
    """The numeric columns as 16M-entry lists of zeros: 5 x 128 MiB of list to the older reader."""
    out = bytearray(b"\x8a")
    out += _key("rd") + b"\x90" + _key("names") + b"\x90"
    for k in ("ra", "rn", "reg", "off", "dims"):
        out += _key(k) + _array_header(_OLD_LIMIT) + b"\x00" * _OLD_LIMIT
    for k in ("dt", "acc", "nd"):
        out += _key(k) + _empty_bin()
    return bytes(out)


@pytest.mark.parametrize(
    "make, match",
    [
        (long_lists, "not valid msgpack .*exceeds max_array_len"),
        (nested_lists, "a list besides 'names' and 'rd'"),
        (nested_maps, "a map inside the map"),
        (numeric_lists, "not valid msgpack .*exceeds max_array_len"),
    ],
)
def test_a_hostile_map_of_64_kib_is_refused_before_it_is_built(make, match):
    raw = make()
    inflated = len(raw)
    data = stored(zlib.compress(raw, 9))
    del raw
    assert len(data) < 128 << 10 and inflated >= 16 * MiB  # small on the wire, large inflated
    tracemalloc.start()
    try:
        with pytest.raises(WireFormatError, match=match):
            decode_peer_record(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(
        f"{make.__name__}: {len(data)} bytes stored, {inflated / MiB:.0f} MiB inflated, "
        f"peak {peak / MiB:.0f} MiB traced while refused"
    )
    assert peak < inflated + 64 * MiB


# --- numbers travel packed; lengths are checked before numbers are read --------------------------


@pytest.mark.parametrize("col", ["ra", "rn", "reg", "off", "dims"])
def test_a_numeric_column_written_as_a_list_is_refused_by_name(col):
    with pytest.raises(WireFormatError, match="must be bytes of packed little-endian"):
        decode_peer_record(with_columns(as_list(col)))


@pytest.mark.parametrize("value", ["abc", 7, None, 1.5])
@pytest.mark.parametrize("col", ["ra", "rn", "reg", "off", "dims"])
def test_a_numeric_column_of_another_type_is_refused_by_name(col, value):
    with pytest.raises(WireFormatError, match=f"column '{col}' must be bytes of packed"):
        decode_peer_record(with_columns(lambda m: m.update({col: value})))


@pytest.mark.parametrize(
    "mutate, match",
    [
        # not whole integers, or not as many as the regions
        (cut("off", slice(0, -1)), "region columns are of unequal length"),
        (cut("off", slice(0, 8)), "region columns are of unequal length"),
        (lambda m: m.update(off=m["off"] + bytes(8)), "region columns are of unequal length"),
        (cut("reg", slice(0, -2)), "region columns are of unequal length"),
        (lambda m: m.update(reg=m["reg"] + bytes(4)), "region columns are of unequal length"),
        (cut("dims", slice(0, -8)), "wrong number of dimensions"),
        (cut("dims", slice(0, -1)), "wrong number of dimensions"),
        (lambda m: m.update(dims=m["dims"] + bytes(8)), "wrong number of dimensions"),
        (cut("ra", slice(0, -8)), "registration columns are of unequal length"),
        (cut("rn", slice(0, -3)), "registration columns are of unequal length"),
        (lambda m: m.update(rd=["cpu"]), "registration columns are of unequal length"),
        (cut("dt", slice(0, 1)), "region columns are of unequal length"),
        # a region's place: an offset into a registration of its peer, inside it
        (poke("off", 0, 4096 - 32), "outside the memory its peer registered"),
        (poke("off", 0, 1 << 56), "bad offset"),
        (poke("off", 0, (1 << 64) - 1), "bad offset"),
        (poke("reg", 0, 2), "names no registration"),
        (poke("reg", 0, (1 << 32) - 1), "names no registration"),
        (poke("dims", 0, 2**40), "outside the memory|too large"),
        (poke("dims", 0, 1 << 63), "bad shape dimension"),
        (poke("dims", 0, (1 << 64) - 1), "bad shape dimension"),
        (lambda m: m.update(nd=bytes([17, 1])), "bad shape"),
        # registrations
        (poke("ra", 0, 0), "malformed registration"),
        (poke("rn", 0, 0), "malformed registration"),
        (poke("rn", 0, (1 << 56) + 1), "malformed registration"),
        (poke("ra", 0, (1 << 64) - 8), "malformed registration"),
        (poke("ra", 0, (1 << 64) - 1), "malformed registration"),
        (lambda m: m.update(ra=b"", rn=b"", rd=[]), "names no registration"),
        # nothing nests
        (lambda m: m.update(names=[["layers.0.w"], "emb"]), "a list besides"),
        (lambda m: m.update(names=[{}, "emb"]), "a map inside the map"),
        (lambda m: m.update(rd=[[], "cpu"]), "a list besides"),
        (lambda m: m.update(names="layers.0.w"), "'names' must be a list"),
        (lambda m: m.update(rd="cpu"), "'rd' must be a list"),
    ],
)
def test_a_malformed_packed_map_is_refused(mutate, match):
    with pytest.raises(WireFormatError, match=match):
        decode_peer_record(with_columns(mutate))


def test_an_honest_map_passes_the_checks_the_malformed_ones_fail():
    assert decode_peer_record(with_columns(lambda m: None)) == record()
    # the largest numbers a map may hold are read back exactly
    top = (1 << 64) - 1 - 4096  # it ends at 2**64 - 1, as far as a registration may
    rec = record(
        regions=(RegionInfo("x", top, 4096, "uint8", (4096,), "r", "cuda:999999"),),
        registrations=((top, 4096, "cuda:999999"),),
    )
    assert decode_peer_record(encode_peer_record(rec)) == rec


def test_a_region_is_placed_by_its_registration_whatever_the_writer_claims():
    """A region of cuda:1 whose registration index is changed to the cpu one takes that
    registration's address and device: no decoded region lies outside registered memory."""
    emb = decode_peer_record(with_columns(poke("reg", 1, 0))).region_map()["emb"]
    assert emb.device == "cpu" and emb.addr == 0x7F0000001000


def test_more_regions_than_the_limit_is_refused_by_the_rule():
    names = [f"r{i}" for i in range(MAX_REGIONS + 1)]
    with pytest.raises(WireFormatError, match=f"more than {MAX_REGIONS} regions"):
        decode_peer_record(with_columns(lambda m: m.update(names=names)))
    with pytest.raises(WireFormatError, match="not valid msgpack .*max_array_len"):
        decode_peer_record(with_columns(lambda m: m.update(names=names + ["one-more"])))


# --- devices -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:17", "cuda:999999"])
def test_devices_accepted(device):
    assert device_ok(device)


@pytest.mark.parametrize(
    "device",
    [
        "cuda:²",
        "cuda:０",
        "cuda:1\n",
        "cuda:",
        "cuda:01",
        "cuda:9999999",
        "CPU",
        "cpu\n",
        "cuda:-1",
        "cuda:+1",
        "cuda: 1",
        "cuda:1 ",
        "cuda",
        "cuda:1" + "0" * 5000,
        "",
        "mps",
        b"cpu",
        0,
        None,
    ],
)
def test_devices_refused(device):
    assert not device_ok(device)


@pytest.mark.parametrize("device", ["cuda:²", "cuda:０", "cuda:1\n", "cuda:01", "CPU"])
def test_a_registration_on_a_device_not_named_in_ascii_is_refused(device):
    def mutate(m: dict[str, Any]) -> None:
        m["rd"][1] = device

    with pytest.raises(WireFormatError, match="malformed registration"):
        decode_peer_record(with_columns(mutate))


# --- an honest map of 200,000 regions ------------------------------------------------------------


def test_a_map_of_200000_regions_round_trips_exactly():
    """Every field of every region: names, addresses, shapes (0 to 4 dimensions), dtypes,
    access and device (three registrations). The decode time is printed (the older list format
    took about as long), not asserted."""
    dtypes = list(DTYPE_SIZES)
    regs = (
        (0x7F0000000000, 1 << 40, "cpu"),
        (0x7E0000000000, 1 << 40, "cuda:0"),
        (0x7E0000000000, 1 << 40, "cuda:17"),
    )
    shapes = [(), (7,), (3, 5), (2, 3, 4), (1, 2, 1, 9)]
    regions, cursor = [], [0, 0, 0]
    for i in range(200_000):
        k, dtype, shape = i % 3, dtypes[i % len(dtypes)], shapes[i % len(shapes)]
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]
        name = f"s{i % 2}/model.layers.{i // 384}.mlp.experts.{i // 3 % 128}.w{i % 3}.{i}"
        regions.append(
            RegionInfo(
                name,
                regs[k][0] + cursor[k],
                nbytes,
                dtype,
                shape,
                ("rw", "w", "r")[i % 3],
                regs[k][2],
            )
        )
        cursor[k] += nbytes + 64 * (i % 5)
    rec = record(regions=tuple(regions), registrations=regs)
    raw = encode_peer_record(rec)
    t = time.perf_counter()
    back = decode_peer_record(raw)
    took = time.perf_counter() - t
    print(f"200,000 regions: record of {len(raw)} bytes, decoded in {took * 1e3:.0f} ms")
    assert back == rec
    assert [r.shape for r in back.regions[:5]] == shapes
