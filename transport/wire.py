"""Wire formats: peer records, heartbeats and notification frames.

Everything a peer or the store hands us passes through here before it is used.
Records are msgpack maps with a format version ``v`` and an exact set of
fields; every field is type-checked and size-limited. Nothing is ever unpickled.

A stored peer record is an *envelope*::

    {"v": 6, "kind": "peer", "body": <bytes>, "sealed": <bool>}

Without a secret the body is the record's msgpack map; with one it is that map sealed with
AES-256-GCM under a key derived from the secret and namespace (``security/sealing.py``): nobody without
the secret learns the connection metadata or the memory map, and nobody can alter it unnoticed.
The registrations and regions travel as one compressed table by column (``memory/region_codec.py``), the
backend's metadata compressed too: the record of a model of 100,000 tensors is about a megabyte.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack

from transport.doorbell import Bell
from transport.errors import SignatureError, WireFormatError
from transport.memory.region_codec import MAX_REGIONS, decode_memory_map, encode_memory_map, inflate
from transport.security.sealing import keys_for

FORMAT_VERSION = 6

# torch's TCPStore (libuv) refuses values over 8 MiB and drops the connection: records stay below
MAX_RECORD_BYTES = 6 << 20
#: a backend's connection metadata, inflated (NIXL's grows with every exposed registration, and
#: compresses well: it travels compressed)
MAX_METADATA_BYTES = 64 << 20
MAX_REGION_NAME = 1024
MAX_DIMS = 16
MAX_NOTIFY_BYTES = 64 << 10

#: peer names and namespaces: they become store keys and agent names
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")
#: a generation as it appears in an agent name: a decimal integer of at most 19 ASCII digits
_GENERATION_RE = re.compile(r"\A[1-9][0-9]{0,18}\Z")
#: the longest agent name: a peer name, '#' and a generation
MAX_AGENT_NAME = 128 + 1 + 19

ACCESS_MODES = ("rw", "w", "r")

#: dtype name -> element size; the dtypes a region may have
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}
_DTYPES = tuple(DTYPE_SIZES)


def check_name(kind: str, name: object) -> str:
    """Validate a peer name or namespace (they become store keys and NIXL agent names)."""
    if not isinstance(name, str):
        raise TypeError(f"{kind} must be a str, got {type(name).__name__}")
    if not NAME_RE.match(name):
        raise ValueError(
            f"{kind} {name!r} is not allowed: use 1 to 128 characters from letters, digits "
            "and '._:-', starting with a letter or digit"
        )
    return name


def check_region_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"region name must be a str, got {type(name).__name__}")
    if not name or len(name) > MAX_REGION_NAME or not name.isprintable():
        raise ValueError(
            f"region name {name[:80]!r} is not allowed: use 1 to {MAX_REGION_NAME} printable characters"
        )
    return name


class RegionInfo(NamedTuple):
    """One exposed memory region of a peer, as its record describes it (immutable; a named tuple
    rather than a dataclass: a peer of 100,000 tensors builds 200,000 of them, and a named tuple
    is the cheaper to build)."""

    name: str
    addr: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    access: str
    device: str  # "cpu" or "cuda:N"

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPE_SIZES[self.dtype]

    @property
    def writable(self) -> bool:
        return "w" in self.access

    @property
    def readable(self) -> bool:
        return "r" in self.access


@dataclass(frozen=True)
class PeerRecord:
    """What a peer publishes about itself: how to connect to it and what it exposes."""

    name: str
    namespace: str
    generation: int
    agent: str
    backend: str
    metadata: bytes
    host: str
    pid: int
    version: str
    created: float
    regions: tuple[RegionInfo, ...]
    #: the registered memory the regions lie in: (address, bytes, device); on the wire a region is
    #: an offset into one of them, so no decoded region reaches outside
    registrations: tuple[tuple[int, int, str], ...] = ()
    #: the size of the record as stored (0 for one not read from the store)
    stored_bytes: int = field(default=0, compare=False)
    #: counts the records one incarnation published (every expose or withdrawal writes the next):
    #: a reader that knows a revision never goes back to an older one put back in the store
    revision: int = 1
    #: this incarnation serves the namespace's store (the embedded one): when it is lost, the
    #: store is lost with it, and nobody waits on the store to learn whether it restarted
    hosts_store: bool = False
    #: where to ring this incarnation when we write to it (transport/doorbell.py); None: nowhere,
    #: it polls
    bell: Bell | None = None

    def region_map(self) -> dict[str, RegionInfo]:
        return {r.name: r for r in self.regions}


_PEER_FIELDS = {
    "name": str,
    "ns": str,
    "gen": int,
    "agent": str,
    "backend": str,
    "md": bytes,
    "host": str,
    "pid": int,
    "version": str,
    "created": float,
    "memory": bytes,
    "rev": int,
    "store": bool,
    "bell": bytes,
}
_ENVELOPE_FIELDS = {"v": int, "kind": str, "body": bytes, "sealed": bool}


def unpack(
    data: object,
    what: str,
    limit: int,
    *,
    max_str: int | None = None,
    max_array: int = MAX_REGIONS,
    max_map: int = 64,
) -> Any:
    """Decode untrusted msgpack of at most ``limit`` bytes (strings and binaries at most
    ``max_str``, default ``limit``); anything else is a WireFormatError naming ``what``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise WireFormatError(f"{what} is {len(data)} bytes; the limit is {limit}")
    try:
        return msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_str or limit,
            max_bin_len=max_str or limit,
            max_array_len=max_array,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types on garbage; all mean the same to us
        raise WireFormatError(f"{what} is not valid msgpack ({type(e).__name__}: {e})") from e


#: the largest count a peer may send: a signed 64-bit int (msgpack carries up to 2**64 - 1)
MAX_COUNT = (1 << 63) - 1


def is_count(value: object) -> bool:
    """Whether ``value`` decoded from the wire is a count: an int (not a bool), from 0 to
    MAX_COUNT."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _check_fields(obj: object, fields: dict[str, type] | set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WireFormatError(f"{what} must be a map, got {type(obj).__name__}")
    keys = set(obj)
    want = set(fields)
    if keys != want:
        missing, extra = sorted(want - keys), sorted(map(str, keys - want))
        raise WireFormatError(
            f"{what} has the wrong fields (missing {missing}, unexpected {extra})"
        )
    if isinstance(fields, dict):
        for k, t in fields.items():
            v = obj[k]
            ok = isinstance(v, t) and not (t is int and isinstance(v, bool))
            if t is float and isinstance(v, int) and not isinstance(v, bool):
                ok = True
            if not ok:
                raise WireFormatError(
                    f"{what} field {k!r} must be {t.__name__}, got {type(v).__name__}"
                )
    return obj


def encode_peer_record(rec: PeerRecord, secret: bytes | None = None) -> bytes:
    """The stored form of ``rec``: sealed (see the module docstring) when ``secret`` is given."""
    body = msgpack.packb(
        {
            "name": rec.name,
            "ns": rec.namespace,
            "gen": rec.generation,
            "agent": rec.agent,
            "backend": rec.backend,
            "md": zlib.compress(rec.metadata, 6),
            "host": rec.host,
            "pid": rec.pid,
            "version": rec.version,
            "created": float(rec.created),
            "rev": rec.revision,
            "store": rec.hosts_store,
            "bell": rec.bell.pack() if rec.bell is not None else b"",
            "memory": encode_memory_map(rec.regions, rec.registrations, _DTYPES, ACCESS_MODES),
        },
        use_bin_type=True,
    )
    if secret:
        body = keys_for(secret, rec.namespace).seal_record(body)
    out: bytes = msgpack.packb(
        {"v": FORMAT_VERSION, "kind": "peer", "body": body, "sealed": bool(secret)},
        use_bin_type=True,
    )
    if len(out) > MAX_RECORD_BYTES:
        raise ValueError(
            f"peer record is {len(out)} bytes, over the {MAX_RECORD_BYTES} limit; expose fewer, larger regions"
        )
    return out


def decode_peer_record(
    data: object, secret: bytes | None = None, namespace: str | None = None
) -> PeerRecord:
    """Decode and validate a stored peer record.

    With ``secret``, a record that is not sealed with it (and ``namespace``) raises
    SignatureError; without one, a sealed record does. With ``namespace``, a record of another
    namespace is rejected.
    """
    m = _record_body(data, secret, namespace)
    metadata = inflate(m["md"], MAX_METADATA_BYTES, "peer record metadata")
    if not metadata:
        raise WireFormatError("peer record metadata is empty")
    for key in ("agent", "backend", "host", "version"):
        if not m[key] or len(m[key]) > 256:
            raise WireFormatError(f"peer record field {key!r} is empty or too long")
    regs, table = decode_memory_map(
        m["memory"], _DTYPES, DTYPE_SIZES, ACCESS_MODES, MAX_REGION_NAME, MAX_DIMS, RegionInfo
    )
    regions = tuple(table)
    try:
        bell = Bell.unpack(m["bell"])
    except ValueError as e:
        raise WireFormatError(f"peer record field 'bell': {e}") from None
    return PeerRecord(
        name=m["name"],
        namespace=m["ns"],
        generation=m["gen"],
        agent=m["agent"],
        backend=m["backend"],
        metadata=metadata,
        host=m["host"],
        pid=m["pid"],
        version=m["version"],
        created=float(m["created"]),
        regions=regions,
        registrations=regs,
        stored_bytes=len(data),  # type: ignore[arg-type]  # bytes: unpack checked
        revision=m["rev"],
        hosts_store=m["store"],
        bell=bell,
    )


def record_generation(
    data: object, secret: bytes | None = None, namespace: str | None = None
) -> int:
    """The generation of a stored peer record, checked as :func:`decode_peer_record` checks it
    but without building its memory map or its metadata (a fixed cost, whatever it lists)."""
    return int(_record_body(data, secret, namespace)["gen"])


def _record_body(data: object, secret: bytes | None, namespace: str | None) -> dict[str, Any]:
    """The checked body of a stored peer record; its memory map and metadata still packed."""
    env = unpack(data, "peer record", MAX_RECORD_BYTES)
    if isinstance(env, dict) and env.get("v") != FORMAT_VERSION:
        raise WireFormatError(
            f"peer record has format version {str(env.get('v'))[:20]}; this library reads version "
            f"{FORMAT_VERSION} (upgrade the older side)"
        )
    env = _check_fields(env, _ENVELOPE_FIELDS, "peer record")
    if env["kind"] != "peer":
        raise WireFormatError(f"record kind {str(env['kind'])[:20]!r} is not a peer record")
    body = env["body"]
    if secret:
        if not env["sealed"]:
            raise SignatureError(
                "peer record is not sealed, but this Transport requires the namespace's secret: "
                "its peer runs without one; pass the same secret= to every peer of the namespace"
            )
        if namespace is None:
            raise ValueError("opening a sealed peer record needs its namespace")
        body = keys_for(secret, namespace).open_record(body)
    elif env["sealed"]:
        raise SignatureError(
            "peer record is sealed: its peer uses the namespace's shared secret and this "
            "Transport has none; pass the same secret= to every peer of the namespace"
        )
    m = _check_fields(
        unpack(body, "peer record body", MAX_RECORD_BYTES), _PEER_FIELDS, "peer record body"
    )
    for key in ("name", "ns"):
        if not NAME_RE.match(m[key]):
            raise WireFormatError(f"peer record has an invalid {key} {m[key][:40]!r}")
    if namespace is not None and m["ns"] != namespace:
        raise WireFormatError(f"peer record belongs to namespace {m['ns']!r}, not {namespace!r}")
    if (
        not 0 < m["gen"] < (1 << 62)
        or not 0 <= m["pid"] < (1 << 31)
        or not 0 < m["rev"] < (1 << 62)
    ):
        raise WireFormatError("peer record has an out-of-range generation, pid or revision")
    return m


# --- heartbeats -------------------------------------------------------------------------------


def encode_heartbeat(generation: int, wall_time: float) -> bytes:
    out: bytes = msgpack.packb({"v": FORMAT_VERSION, "gen": generation, "t": float(wall_time)})
    return out


def decode_heartbeat(data: object) -> tuple[int, float]:
    m = _check_fields(
        unpack(data, "heartbeat", 256), {"v": int, "gen": int, "t": float}, "heartbeat"
    )
    if m["v"] != FORMAT_VERSION:
        raise WireFormatError(f"heartbeat has format version {m['v']!r}")
    return m["gen"], float(m["t"])


# --- notification frames ----------------------------------------------------------------------
# The first byte says what a notification carries; users' payloads travel after TAG_USER.

TAG_USER = 0x75  # "u"
TAG_CONTROL = 0x63  # "c": messages of the library's own layers (for example weight sync)
_TAG_USER_BYTES = bytes([TAG_USER])
MAX_CHANNEL = 32


#: the largest frame a notification may be: tag, channel length, channel, payload
MAX_FRAME_BYTES = 2 + MAX_CHANNEL + MAX_NOTIFY_BYTES


def frame_user_notification(payload: object) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"notify must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_NOTIFY_BYTES:
        raise ValueError(f"notify payload is {len(payload)} bytes; the limit is {MAX_NOTIFY_BYTES}")
    return _TAG_USER_BYTES + bytes(payload)


def frame_control(channel: str, payload: bytes) -> bytes:
    """A library-internal message on ``channel`` (1 to 32 ASCII characters)."""
    raw = channel.encode("ascii")
    if not 0 < len(raw) <= MAX_CHANNEL:
        raise ValueError(f"control channel {channel!r} must be 1 to {MAX_CHANNEL} ASCII characters")
    if len(payload) > MAX_NOTIFY_BYTES:
        raise ValueError(
            f"control payload is {len(payload)} bytes; the limit is {MAX_NOTIFY_BYTES}"
        )
    return bytes([TAG_CONTROL, len(raw)]) + raw + payload


def parse_notification(frame: bytes) -> tuple[int, str, bytes]:
    """Split a received frame into (tag, channel, payload); the channel is "" for users'
    notifications. WireFormatError for an empty, unknown, truncated or oversized frame (the limit
    is checked on receipt too: a sender need not be this library)."""
    if not frame:
        raise WireFormatError("empty notification frame")
    if len(frame) > MAX_FRAME_BYTES:
        raise WireFormatError(_oversized(len(frame)))
    tag = frame[0]
    if tag == TAG_USER:
        if len(frame) - 1 > MAX_NOTIFY_BYTES:
            raise WireFormatError(_oversized(len(frame) - 1))
        return tag, "", frame[1:]
    if tag == TAG_CONTROL:
        if len(frame) < 2 or not 0 < frame[1] <= MAX_CHANNEL or len(frame) < 2 + frame[1]:
            raise WireFormatError("truncated control notification")
        try:
            channel = frame[2 : 2 + frame[1]].decode("ascii")
        except UnicodeDecodeError:
            raise WireFormatError("control notification channel is not ASCII") from None
        payload = frame[2 + frame[1] :]
        if len(payload) > MAX_NOTIFY_BYTES:
            raise WireFormatError(_oversized(len(payload)))
        return tag, channel, payload
    raise WireFormatError(f"notification frame has unknown tag 0x{tag:02x}")


def _oversized(n: int) -> str:
    return f"a notification of {n} bytes; the most a peer may send is {MAX_NOTIFY_BYTES}"


def agent_name(peer: str, generation: int) -> str:
    """The backend agent name of a peer incarnation; `peer_of_agent` inverts it."""
    return f"{peer}#{generation}"


def peer_of_agent(agent: object) -> tuple[str, int] | None:
    """The (peer name, generation) an agent name stands for; None for anything else (whatever a
    remote agent calls itself: too long, not ASCII, a generation such as '²' or of 5,000 digits)."""
    if not isinstance(agent, str) or len(agent) > MAX_AGENT_NAME:
        return None
    name, sep, gen = agent.rpartition("#")
    if not sep or not _GENERATION_RE.match(gen) or not NAME_RE.match(name):
        return None
    return name, int(gen)
