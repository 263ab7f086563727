"""A peer's memory map on the wire: compact, so a model of 100,000 tensors fits in one record.

A record lists the memory its peer registered and every region it exposes in it, and a
mixture-of-experts model exposes one region per tensor (a subscriber with two staging slots, two
per tensor). Written as one list per region, 200,000 regions took 13 MiB, over what TCPStore
takes in one value (8 MiB). The map is therefore written by column and compressed::

    zlib(msgpack({
        "ra": bytes, "rn": bytes,  # registrations: address, bytes (<u8 each)
        "rd": [str],               # and device ("cpu" or "cuda:N")
        "names": [str],            # the regions' names
        "reg":  bytes,   # <u4: index of the registration the region lies in
        "off":  bytes,   # <u8: its offset in that registration
        "dt":   bytes,   # dtype code per region (the order the caller gives)
        "acc":  bytes,   # access code per region (likewise)
        "nd":   bytes,   # number of dimensions per region
        "dims": bytes,   # <u8: every region's shape, one after the other
    }))

A region's address is its registration's plus its offset, its device its registration's, its
byte count its shape's: a decoded map cannot place a region outside the memory its peer
registered, or give it a size its shape disagrees with. Names are most of a map's bytes, and
names in a state dict's order repeat long runs of the name before
(``model.layers.12.mlp.experts.57.``): zlib takes most of them.

Numbers travel packed (little-endian, fixed width), never as msgpack lists: a reader checks a
column's byte length against the count it must have before it looks at a number, and builds no
Python object per number it refuses. msgpack's limits keep a list to MAX_REGIONS entries and a
string to a name's length, and the map may hold no list or map but its own two lists and
itself: a small compressed map cannot make a reader build more objects than the largest honest
one. (Written as lists, a map of 64 KiB made a reader build gigabytes of them before it counted
the regions; tests/memory/test_region_table_bounds.py keeps such maps.)
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from transport.errors import WireFormatError
from transport.gc_pause import without_gc

# The budget of one record, for its reader: what the largest real model needs, not what the wire
# could carry. DeepSeek-V3 has about 91,000 tensors, so a subscriber with two staging slots lists
# about 182,000 regions, of four dimensions at most, named in about 60 bytes each (a map of about
# 18 MiB). A record within these bounds costs a reader at most the memory and CPU time
# benchmarks/README.md gives ("What a record costs its reader"), whoever wrote it; the counts are
# checked before anything is built per region.
#: regions (and registrations) one peer may list
MAX_REGIONS = 1 << 18
#: dimensions of all of a record's regions together (four per region, at the most regions)
MAX_TOTAL_DIMS = 1 << 20
#: what a map may inflate to (names, then the packed columns): a peer's compressed map cannot
#: make us allocate more
MAX_MAP_BYTES = 48 << 20
_MAX_U64 = (1 << 64) - 1
_MAX_EXTENT = 1 << 56
_COLUMNS = ("ra", "rn", "rd", "names", "reg", "off", "dt", "acc", "nd", "dims")
#: how the numeric columns travel: packed little-endian integers of a fixed width
_U64 = np.dtype("<u8")  # addresses, byte counts, offsets, dimensions
_U32 = np.dtype("<u4")  # registration indexes (at most MAX_REGIONS)
#: "cpu" or "cuda:N", N a decimal of at most 6 ASCII digits without a leading zero
_DEVICE_RE = re.compile(r"cpu|cuda:(?:0|[1-9][0-9]{0,5})", re.ASCII)
_MAX_DEVICE = len("cuda:999999")

Registration = tuple[int, int, str]  # (address, bytes, device)
T = TypeVar("T")


def encode_memory_map(
    regions: Sequence[Any],
    registrations: Sequence[Registration],
    dtypes: Sequence[str],
    accesses: Sequence[str],
) -> bytes:
    """The compressed map of ``registrations`` and ``regions`` (RegionInfo), each region lying in
    one of the registrations (ValueError otherwise: every reader would refuse the record)."""
    if len(regions) > MAX_REGIONS or len(registrations) > MAX_REGIONS:
        raise ValueError(
            f"{len(regions)} regions in {len(registrations)} registrations are over the limit of "
            f"{MAX_REGIONS} per peer; expose fewer, larger regions (for example one flat buffer "
            "with views)"
        )
    dcode = {d: i for i, d in enumerate(dtypes)}
    acode = {a: i for i, a in enumerate(accesses)}
    names = [r.name for r in regions]
    addr = np.fromiter((r.addr for r in regions), np.uint64, len(regions))
    ends = addr + np.fromiter((r.nbytes for r in regions), np.uint64, len(regions))
    wraps = ends < addr  # past the top of the address space: in no registration
    reg = np.full(len(regions), -1, np.int64)
    off = np.zeros(len(regions), np.uint64)
    # each region in the registration of its device whose span holds its start (registrations
    # of two devices may share an address)
    devices = np.array([r.device for r in regions], dtype=object)
    for dev in set(devices.tolist()):
        mine = np.flatnonzero(devices == dev)
        spans = sorted((a, a + n, i) for i, (a, n, d) in enumerate(registrations) if d == dev)
        if not spans:
            continue
        starts = np.array([sp[0] for sp in spans], np.uint64)
        k = np.searchsorted(starts, addr[mine], side="right").astype(np.int64) - 1
        inside = (k >= 0) & ~wraps[mine]
        k = np.maximum(k, 0)
        inside &= ends[mine] <= np.array([sp[1] for sp in spans], np.uint64)[k]
        reg[mine[inside]] = np.array([sp[2] for sp in spans], np.int64)[k[inside]]
        off[mine[inside]] = addr[mine[inside]] - starts[k[inside]]
    if (reg < 0).any():
        r = regions[int(np.flatnonzero(reg < 0)[0])]
        raise ValueError(
            f"region {r.name!r} ({r.nbytes} bytes at {r.addr:#x} on {r.device}) lies outside "
            "the memory this peer registered"
        )
    dims = [d for r in regions for d in r.shape]
    packed: bytes = msgpack.packb(
        {
            "ra": _pack([r[0] for r in registrations], _U64),
            "rn": _pack([r[1] for r in registrations], _U64),
            "rd": [r[2] for r in registrations],
            "names": names,
            "reg": reg.astype(_U32).tobytes(),
            "off": off.astype(_U64).tobytes(),
            "dt": bytes([dcode[r.dtype] for r in regions]),
            "acc": bytes([acode[r.access] for r in regions]),
            "nd": bytes([len(r.shape) for r in regions]),
            "dims": _pack(dims, _U64),
        },
        use_bin_type=True,
    )
    if len(dims) > MAX_TOTAL_DIMS or len(packed) > MAX_MAP_BYTES:
        raise ValueError(
            f"{len(regions)} regions of {len(dims)} dimensions in all, {len(packed)} bytes of "
            f"names and columns, are over a record's budget ({MAX_TOTAL_DIMS} dimensions, "
            f"{MAX_MAP_BYTES} bytes); expose fewer, larger regions (for example one flat buffer "
            "with views), or shorter names"
        )
    return zlib.compress(packed, 6)


def _pack(values: list[int], dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype).tobytes()


@without_gc  # 200,000 new objects would start many collections, each scanning them all
def decode_memory_map(
    data: bytes,
    dtypes: Sequence[str],
    dtype_sizes: dict[str, int],
    accesses: Sequence[str],
    max_name: int,
    max_dims: int,
    make: Callable[[str, int, int, str, tuple[int, ...], str, str], T],
) -> tuple[tuple[Registration, ...], list[T]]:
    """The registrations and regions (each ``make(name, addr, nbytes, dtype, shape, access,
    device)``) of a map, checked; WireFormatError naming the registration
    or region for anything a well-behaved peer would not write. Every column's length is checked
    before its values are read; the checks run by column (numpy), not region by region."""
    m = _inflate(data, max_name, max_dims)
    names = m["names"]
    if not isinstance(names, list):
        raise WireFormatError(
            f"peer record's memory map column 'names' must be a list, got {type(names).__name__}"
        )
    n = len(names)
    if n > MAX_REGIONS:
        raise WireFormatError(f"peer record has more than {MAX_REGIONS} regions")
    regs = _registrations(m)
    unequal = "peer record's region columns are of unequal length"
    reg_a = _packed(m, "reg", _U32, n, unequal)
    off_a = _packed(m, "off", _U64, n, unequal)
    dt, acc, nd = m["dt"], m["acc"], m["nd"]
    for col in (dt, acc, nd):
        if type(col) is not bytes or len(col) != n:
            raise WireFormatError(unequal)
    for i, name in enumerate(names):
        if type(name) is not str or not 0 < len(name) <= max_name:
            raise WireFormatError(f"region #{i} has a bad name")
    if len(set(names)) != n:
        seen: set[str] = set()
        twice = next(x for x in names if x in seen or seen.add(x))  # type: ignore[func-returns-value]
        raise WireFormatError(f"peer record lists region {twice[:80]!r} twice")
    _refuse(reg_a >= len(regs), names, "names no registration of its peer")
    _refuse(off_a >= _MAX_EXTENT, names, "has a bad offset")
    dt_a = np.frombuffer(dt, np.uint8).astype(np.int64)
    acc_a = np.frombuffer(acc, np.uint8)
    nd_a = np.frombuffer(nd, np.uint8).astype(np.int64)
    _refuse(dt_a >= len(dtypes), names, "has an unknown dtype")
    _refuse(acc_a >= len(accesses), names, "has an unknown access")
    _refuse(nd_a > max_dims, names, "has a bad shape")
    if int(nd_a.sum()) > MAX_TOTAL_DIMS:
        raise WireFormatError(
            f"peer record's regions have more than {MAX_TOTAL_DIMS} dimensions in all"
        )
    # at most n * max_dims dimensions: the count is checked before a byte of them is read
    dims_a = _packed(
        m,
        "dims",
        _U64,
        int(nd_a.sum()),
        "peer record's region table has the wrong number of dimensions",
    )
    _refuse(dims_a >= _MAX_EXTENT, None, "a region has a bad shape dimension")
    dims_i = dims_a.astype(np.int64)
    # the byte count of every region: its shape's product times its dtype's size (in floats
    # first: a product past 2**62 would wrap in integers, and no registration is that large)
    ends = np.cumsum(nd_a)
    starts = ends - nd_a
    grid = np.ones((n, max(int(nd_a.max(initial=0)), 1)), np.int64)
    if len(dims_i):
        row = np.repeat(np.arange(n), nd_a)
        grid[row, np.arange(len(dims_i)) - np.repeat(starts, nd_a)] = dims_i
    sizes = np.array([dtype_sizes[d] for d in dtypes], np.int64)[dt_a]
    _refuse(grid.astype(np.float64).prod(axis=1) * sizes > 2.0**60, names, "is too large")
    nbytes = grid.prod(axis=1) * sizes
    reg_size = np.array([r[1] for r in regs], np.int64)[reg_a] if regs else np.zeros(0, np.int64)
    _refuse(
        off_a.astype(np.int64) + nbytes > reg_size,
        names,
        "lies outside the memory its peer registered",
    )
    base = np.array([r[0] for r in regs], np.uint64)
    dev = np.array([r[2] for r in regs] or [""], object)
    # the regions' columns as lists, then one object per region (no work per region in Python
    # but building it)
    addrs = (base[reg_a] + off_a).tolist() if regs else []
    shapes = [tuple(row[:k]) for row, k in zip(grid.tolist(), nd_a.tolist(), strict=True)]
    columns = (
        names,
        addrs,
        nbytes.tolist(),
        np.array(dtypes, object)[dt_a].tolist(),
        shapes,
        np.array(accesses, object)[acc_a].tolist(),
        dev[reg_a].tolist() if regs else [],
    )
    out: list[T] = list(map(make, *columns))
    return regs, out


def _packed(m: dict[str, Any], col: str, dtype: np.dtype, count: int, rule: str) -> np.ndarray:
    """Column ``col`` of ``m``: ``count`` packed integers of ``dtype``, viewed, not copied. Its
    type and byte length are checked before it is read: WireFormatError(``rule``) for a length
    that is not ``count`` whole integers, and a list (or anything else) is refused by name."""
    v = m[col]
    width = f"little-endian {dtype.itemsize * 8}-bit integers"
    if type(v) is not bytes:
        raise WireFormatError(
            f"peer record's memory map column {col!r} must be bytes of packed {width}, got "
            f"{type(v).__name__} (its writer runs a release with another map format?)"
        )
    if len(v) != count * dtype.itemsize:
        raise WireFormatError(f"{rule} (column {col!r} is {len(v)} bytes, not {count} {width})")
    return np.frombuffer(v, dtype)


def _refuse(bad: np.ndarray, names: list[str] | None, rule: str) -> None:
    if bad.any():
        if names is None:
            raise WireFormatError(f"peer record: {rule}; the record is refused")
        i = int(np.argmax(bad))
        raise WireFormatError(f"region {names[i][:80]!r} {rule}; the record is refused")


def inflate(data: bytes, limit: int, what: str) -> bytes:
    """``data`` decompressed (zlib), if it inflates to at most ``limit`` bytes: a peer's few
    compressed bytes cannot make us allocate more. WireFormatError naming ``what`` otherwise."""
    return b"".join(list(_pieces(data, limit, what)))


def _inflate_exact(data: bytes, limit: int, what: str) -> bytearray:
    """``inflate``, in one buffer of the inflated size, allocated once the stream has proved
    complete and within ``limit`` (a first pass keeps nothing): zlib's one-shot output, blocks
    joined at the end, takes twice the output at the peak."""
    out = bytearray(sum(len(piece) for piece in _pieces(data, limit, what)))
    pos = 0
    with memoryview(out) as view:
        for piece in _pieces(data, limit, what):
            view[pos : pos + len(piece)] = piece
            pos += len(piece)
    return out


#: inflating, what zlib reads and writes in one step
_PIECE_IN = 64 << 10
_PIECE_OUT = 1 << 20


def _pieces(data: bytes, limit: int, what: str) -> Iterator[bytes]:
    """The inflated ``data`` in pieces of at most a MiB; WireFormatError naming ``what`` once it
    is past ``limit`` bytes, and at the end of a truncated or corrupt stream."""
    inflater = zlib.decompressobj()
    view = memoryview(data)
    n, pos, pending = 0, 0, memoryview(b"")
    try:
        while not inflater.eof:
            if not pending and pos < len(view):
                pending, pos = view[pos : pos + _PIECE_IN], pos + _PIECE_IN
            piece = inflater.decompress(pending, min(_PIECE_OUT, limit + 1 - n))
            n += len(piece)
            if n > limit:
                break
            yield piece
            pending = memoryview(inflater.unconsumed_tail)
            if not piece and not pending and pos >= len(view):
                break  # the input ended before the stream did
    except zlib.error as e:
        raise WireFormatError(f"{what} is not valid zlib ({e})") from e
    if n > limit or not inflater.eof:
        raise WireFormatError(f"{what} is truncated or inflates past {limit} bytes")


class _Containers:
    """msgpack's hooks for one map: it may build two lists (names, rd) and one map (itself). A
    hook runs once a container is built, innermost first, so a third list, nested or not, is
    refused once built, before a fourth: empty lists are one byte each, and a map of 64 KiB would
    otherwise build 64 million of them."""

    def __init__(self) -> None:
        self.lists = self.maps = 0

    def list_hook(self, v: list[Any]) -> list[Any]:
        if len(v) > MAX_REGIONS:  # msgpack allows one over, for this message
            raise WireFormatError(
                f"peer record has more than {MAX_REGIONS} regions or registrations"
            )
        self.lists += 1
        if self.lists > 2:
            raise WireFormatError(
                "peer record's memory map holds a list besides 'names' and 'rd' (of strings): "
                "its numeric columns must be bytes of packed little-endian integers, and no list "
                "nests in another"
            )
        return v

    def object_hook(self, v: dict[str, Any]) -> dict[str, Any]:
        self.maps += 1
        if self.maps > 1:
            raise WireFormatError("peer record's memory map holds a map inside the map")
        return v


def _inflate(data: bytes, max_name: int, max_dims: int) -> dict[str, Any]:
    raw = _inflate_exact(data, MAX_MAP_BYTES, "peer record's memory map")
    hooks = _Containers()
    try:
        m = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # a name in UTF-8 (keys and devices are shorter)
            max_str_len=4 * max_name,
            # the largest column: every region's dimensions
            max_bin_len=MAX_REGIONS * max_dims * _U64.itemsize,
            # names and rd; one over, so that a list too long is refused by the rule
            max_array_len=MAX_REGIONS + 1,
            max_map_len=16,
            max_ext_len=0,
            list_hook=hooks.list_hook,
            object_hook=hooks.object_hook,
        )
    except WireFormatError:
        raise
    except Exception as e:  # msgpack raises many types on garbage; all mean the same to us
        raise WireFormatError(f"peer record's memory map is not valid msgpack ({e})") from e
    if not isinstance(m, dict) or set(m) != set(_COLUMNS):
        raise WireFormatError(f"peer record's memory map must be a map of {list(_COLUMNS)}")
    return m


def _registrations(m: dict[str, Any]) -> tuple[Registration, ...]:
    rd = m["rd"]
    if not isinstance(rd, list):
        raise WireFormatError(
            f"peer record's memory map column 'rd' must be a list, got {type(rd).__name__}"
        )
    if len(rd) > MAX_REGIONS:
        raise WireFormatError(f"peer record has more than {MAX_REGIONS} registrations")
    unequal = "peer record's registration columns are of unequal length"
    ra = _packed(m, "ra", _U64, len(rd), unequal)
    rn = _packed(m, "rn", _U64, len(rd), unequal)
    # an address is never 0; a registration is at most 2**56 bytes and ends inside 64 bits
    bad = (ra == 0) | (rn == 0) | (rn > _MAX_EXTENT) | (ra > _MAX_U64 - rn)
    bad |= np.fromiter((not device_ok(d) for d in rd), bool, len(rd))
    if bad.any():
        i = int(np.argmax(bad))
        raise WireFormatError(
            f"peer record has a malformed registration {str([int(ra[i]), int(rn[i]), rd[i]])[:60]}"
        )
    return tuple(zip(ra.tolist(), rn.tolist(), rd, strict=True))


def device_ok(device: object) -> bool:
    """``device`` is "cpu" or "cuda:N" (N in ASCII decimal, no leading zero, at most 6 digits;
    not '²', '０' or a trailing newline)."""
    return (
        type(device) is str
        and len(device) <= _MAX_DEVICE
        and _DEVICE_RE.fullmatch(device) is not None
    )
