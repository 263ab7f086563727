"""A peer's memory map on the wire: compact, so a model of 100,000 tensors fits in one record.

A record lists the memory its peer registered and every region it exposes in it, and a
mixture-of-experts model exposes one region per tensor (a subscriber with two staging slots, two
per tensor). Written as one list per region, 200,000 regions took 13 MiB, over what TCPStore
takes in one value (8 MiB). The map is therefore written by column and compressed::

    zlib(msgpack({
        "ra": [int], "rn": [int], "rd": [str],  # registrations: address, bytes, device
        "names": [str],  # the regions' names
        "reg":  [int],   # index of the registration the region lies in
        "off":  [int],   # its offset in that registration
        "dt":   bytes,   # dtype code per region (the order the caller gives)
        "acc":  bytes,   # access code per region (likewise)
        "nd":   bytes,   # number of dimensions per region
        "dims": [int],   # every region's shape, one after the other
    }))

A region's address is its registration's plus its offset, its device its registration's, its
byte count its shape's: a decoded map cannot place a region outside the memory its peer
registered, or give it a size its shape disagrees with. Names are most of a map's bytes, and
names in a state dict's order repeat long runs of the name before
(``model.layers.12.mlp.experts.57.``): zlib takes most of them.
"""

from __future__ import annotations

import bisect
import gc
import zlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from transport.errors import WireFormatError

#: regions (and registrations) one peer may list: far above any model (DeepSeek-V3 has about
#: 91,000 tensors, so a subscriber with two staging slots about 182,000); the bound is there for
#: the reader's memory, not the wire
MAX_REGIONS = 1 << 20
#: what a map may inflate to: a peer's compressed map cannot make us allocate more
MAX_MAP_BYTES = 256 << 20
_MAX_U64 = (1 << 64) - 1
_MAX_EXTENT = 1 << 56
_COLUMNS = ("ra", "rn", "rd", "names", "reg", "off", "dt", "acc", "nd", "dims")

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
    spans = sorted((addr, addr + n, dev, i) for i, (addr, n, dev) in enumerate(registrations))
    starts = [s[0] for s in spans]
    names, reg, off, dims = [], [], [], []
    dt, acc, nd = bytearray(), bytearray(), bytearray()
    for r in regions:
        k = bisect.bisect_right(starts, r.addr) - 1
        # registrations of two devices may share an address: look back for this one's device
        while k >= 0 and spans[k][2] != r.device:
            k -= 1
        if k < 0 or r.addr + r.nbytes > spans[k][1]:
            raise ValueError(
                f"region {r.name!r} ({r.nbytes} bytes at {r.addr:#x} on {r.device}) lies outside "
                "the memory this peer registered"
            )
        names.append(r.name)
        reg.append(spans[k][3])
        off.append(r.addr - spans[k][0])
        dt.append(dcode[r.dtype])
        acc.append(acode[r.access])
        nd.append(len(r.shape))
        dims.extend(r.shape)
    packed: bytes = msgpack.packb(
        {"ra": [r[0] for r in registrations], "rn": [r[1] for r in registrations],
         "rd": [r[2] for r in registrations], "names": names, "reg": reg, "off": off,
         "dt": bytes(dt), "acc": bytes(acc), "nd": bytes(nd), "dims": dims},
        use_bin_type=True,
    )  # fmt: skip
    return zlib.compress(packed, 6)


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
    or region for anything a well-behaved peer would not write. The checks run by column (numpy),
    not region by region."""
    m = _inflate(data, max_dims)
    regs = _registrations(m["ra"], m["rn"], m["rd"])
    names, reg, off, dt, acc, nd, dims = (m[c] for c in _COLUMNS[3:])
    n = len(names) if isinstance(names, list) else -1
    if n > MAX_REGIONS:
        raise WireFormatError(f"peer record has more than {MAX_REGIONS} regions")
    for col, kind in ((reg, list), (off, list), (dt, bytes), (acc, bytes), (nd, bytes)):
        if not isinstance(col, kind) or len(col) != n:
            raise WireFormatError("peer record's region columns are of unequal length")
    for i, name in enumerate(names):
        if type(name) is not str or not 0 < len(name) <= max_name:
            raise WireFormatError(f"region #{i} has a bad name")
    if len(set(names)) != n:
        seen: set[str] = set()
        twice = next(x for x in names if x in seen or seen.add(x))  # type: ignore[func-returns-value]
        raise WireFormatError(f"peer record lists region {twice[:80]!r} twice")
    reg_a = _column(reg, len(regs), names, "names no registration of its peer")
    off_a = _column(off, _MAX_EXTENT, names, "has a bad offset")
    dt_a = np.frombuffer(dt, np.uint8).astype(np.int64)
    acc_a = np.frombuffer(acc, np.uint8)
    nd_a = np.frombuffer(nd, np.uint8).astype(np.int64)
    _refuse(dt_a >= len(dtypes), names, "has an unknown dtype")
    _refuse(acc_a >= len(accesses), names, "has an unknown access")
    _refuse(nd_a > max_dims, names, "has a bad shape")
    if not isinstance(dims, list) or len(dims) != int(nd_a.sum()):
        raise WireFormatError("peer record's region table has the wrong number of dimensions")
    dims_a = _column(dims, _MAX_EXTENT, None, "a region has a bad shape dimension")
    # the byte count of every region: its shape's product times its dtype's size (in floats
    # first: a product past 2**62 would wrap in integers, and no registration is that large)
    ends = np.cumsum(nd_a)
    starts = ends - nd_a
    grid = np.ones((n, max(int(nd_a.max(initial=0)), 1)), np.int64)
    if len(dims_a):
        row = np.repeat(np.arange(n), nd_a)
        grid[row, np.arange(len(dims_a)) - np.repeat(starts, nd_a)] = dims_a
    sizes = np.array([dtype_sizes[d] for d in dtypes], np.int64)[dt_a]
    _refuse(grid.astype(np.float64).prod(axis=1) * sizes > 2.0**60, names, "is too large")
    nbytes = grid.prod(axis=1) * sizes
    reg_size = np.array([r[1] for r in regs], np.int64)[reg_a] if regs else np.zeros(0, np.int64)
    _refuse(off_a + nbytes > reg_size, names, "lies outside the memory its peer registered")
    base = [r[0] for r in regs]
    dev = [r[2] for r in regs]
    access = [accesses[a] for a in acc_a.tolist()]
    out: list[T] = []
    st, en, dtype_of = starts.tolist(), ends.tolist(), dt_a.tolist()
    enabled = gc.isenabled()
    gc.disable()  # 200,000 new objects would start many collections, each scanning them all
    try:
        for i, (k, o, b) in enumerate(zip(reg, off, nbytes.tolist(), strict=True)):
            shape = tuple(dims[st[i] : en[i]])
            out.append(
                make(names[i], base[k] + o, b, dtypes[dtype_of[i]], shape, access[i], dev[k])
            )
    finally:
        if enabled:
            gc.enable()
    return regs, out


def _column(values: object, bound: int, names: list[str] | None, rule: str) -> np.ndarray:
    """``values`` as an int64 array, each an int in [0, bound); else a WireFormatError that names
    the first region (when ``names`` is given) breaking ``rule``."""
    try:
        a = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        a = None
    if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise WireFormatError(f"peer record's region table has a non-integer where {rule}")
    if a.size and a.dtype.kind == "u" and int(a.max()) >= bound:
        _refuse(a >= bound, names, rule)
    a = a.astype(np.int64)
    _refuse((a < 0) | (a >= bound), names, rule)
    return a


def _refuse(bad: np.ndarray, names: list[str] | None, rule: str) -> None:
    if bad.any():
        if names is None:
            raise WireFormatError(f"peer record: {rule}; the record is refused")
        i = int(np.argmax(bad))
        raise WireFormatError(f"region {names[i][:80]!r} {rule}; the record is refused")


def inflate(data: bytes, limit: int, what: str) -> bytes:
    """``data`` decompressed (zlib), if it inflates to at most ``limit`` bytes: a peer's few
    compressed bytes cannot make us allocate more. WireFormatError naming ``what`` otherwise."""
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(data, limit)
    except zlib.error as e:
        raise WireFormatError(f"{what} is not valid zlib ({e})") from e
    if inflater.unconsumed_tail or not inflater.eof:
        raise WireFormatError(f"{what} is truncated or inflates past {limit} bytes")
    return raw


def _inflate(data: bytes, max_dims: int) -> dict[str, Any]:
    raw = inflate(data, MAX_MAP_BYTES, "peer record's memory map")
    try:
        m = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, use_list=True, max_str_len=MAX_MAP_BYTES,
            max_bin_len=MAX_MAP_BYTES, max_array_len=MAX_REGIONS * max_dims, max_map_len=16,
            max_ext_len=0,
        )  # fmt: skip
    except Exception as e:  # msgpack raises many types on garbage; all mean the same to us
        raise WireFormatError(f"peer record's memory map is not valid msgpack ({e})") from e
    if not isinstance(m, dict) or set(m) != set(_COLUMNS):
        raise WireFormatError(f"peer record's memory map must be a map of {list(_COLUMNS)}")
    return m


def _registrations(ra: object, rn: object, rd: object) -> tuple[Registration, ...]:
    if not all(isinstance(c, list) for c in (ra, rn, rd)) or not len(ra) == len(rn) == len(rd):  # type: ignore[arg-type]
        raise WireFormatError("peer record's registration columns are of unequal length")
    if len(ra) > MAX_REGIONS:  # type: ignore[arg-type]
        raise WireFormatError(f"peer record has more than {MAX_REGIONS} registrations")
    out = []
    for addr, n, dev in zip(ra, rn, rd, strict=True):  # type: ignore[call-overload]
        if (
            not _small_int(addr, _MAX_U64)
            or addr == 0
            or not _small_int(n, _MAX_EXTENT + 1)
            or n == 0
            or addr + n > _MAX_U64
            or not device_ok(dev)
        ):
            raise WireFormatError(
                f"peer record has a malformed registration {str([addr, n, dev])[:60]}"
            )
        out.append((addr, n, dev))
    return tuple(out)


def device_ok(device: object) -> bool:
    """``device`` is "cpu" or "cuda:N"."""
    return isinstance(device, str) and (
        device == "cpu"
        or (device.startswith("cuda:") and device[5:].isdigit() and len(device) < 12)
    )


def _small_int(v: object, bound: int) -> bool:
    """``v`` is an int in [0, bound) (and not a bool)."""
    return type(v) is int and 0 <= v < bound
