"""Every decoder of bytes that reach a process from outside it, as a fuzz target.

A :class:`Target` owns one decoder: ``run(data)`` decodes one input the way the library reads
such bytes, ``allowed`` is the error a decoder may raise for bad input (the library's error
tree: WireFormatError, SignatureError, DeltaError; ValueError where the contract says so),
``seeds()`` builds valid encodings with the library's own encoders (the seed corpus in
``corpus/<name>/`` holds them), ``code`` names what its coverage is measured over (modules,
classes or functions) and ``budget`` the most memory one input may make the decoder allocate
at its peak (Python's allocations, as tracemalloc counts them).

The rules a target checks beyond "no other exception": what a decoder accepts is well formed
(the types a caller relies on), and an accepted delta applies within its tensors.

Three kinds of target read through a seal: the outsider's (the sealed bytes as they come; no
mutation gets past the MAC, so these prove only that the check holds), and the insider's, where
the target seals the fuzzed bytes itself with the namespace's keys before decoding (a peer that
holds the secret but sends garbage, which must not crash its readers either).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import types
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from transport import RegionInfo, RouteError, WireFormatError, wire
from transport.backends import cma
from transport.doorbell import Bell
from transport.memory import region_codec
from transport.memory.regions import Withdraw
from transport.security import sealing, signed
from transport.security.sealing import FrameOpener, keys_for
from transport.security.signed import SignedStore
from transport.store import MemoryStore
from transport.store.counters import Counter
from transport.weights import message_codec
from transport.weights.buckets import messages as bucket_messages
from transport.weights.buckets import topology
from transport.weights.delta import decoder as delta_decoder
from transport.weights.delta.codec import DeltaLayout
from transport.weights.delta.codec import encode as delta_encode
from transport.weights.group import group_directory, lease, region_names
from transport.weights.group import messages as group_messages
from transport.weights.layouts import encoding as layout_encoding

GROUP_CHANNEL = region_names.channel("policy")
SECRET = b"fuzz-secret-0123456789"
NAMESPACE = "ns"
KEYS = keys_for(SECRET, NAMESPACE)
MiB = 1 << 20


@dataclass(frozen=True)
class Target:
    """One decoder under fuzzing (see the module docstring)."""

    name: str
    run: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    code: tuple[object, ...]
    budget: int = 16 * MiB


class Rejected(AssertionError):
    """A decoder accepted what breaks its own rules (a fuzz finding, never an allowed error)."""


# --- peer records, heartbeats, notification frames ---------------------------------------------


def _record(regions: int = 6, device: str = "cpu") -> wire.PeerRecord:
    dtypes = ("float32", "bfloat16", "int8", "float16", "int64", "uint8")
    infos = tuple(
        RegionInfo(
            f"layers.{i}.w",
            0x7F0000000000 + i * 8192,
            4096,
            dtypes[i % len(dtypes)],
            (32, 4096 // 32 // wire.DTYPE_SIZES[dtypes[i % len(dtypes)]]),
            wire.ACCESS_MODES[i % 3],
            device,
        )
        for i in range(regions)
    )
    return wire.PeerRecord(
        name="gen-0",
        namespace=NAMESPACE,
        generation=7,
        agent=wire.agent_name("gen-0", 7),
        backend="nixl",
        metadata=bytes(range(256)) * 2,
        host="host-a",
        pid=1234,
        version="0.1.0",
        created=1.5,
        regions=infos,
        registrations=((0x7F0000000000, max(regions, 1) * 8192, device),),
        revision=3,
        hosts_store=regions % 2 == 0,
        # no bell, an IPv4 one and an IPv6 one
        bell=(None, Bell("10.0.0.7", 40001, bytes(range(16))), Bell("fd00::7", 9, b"t" * 16))[
            regions % 3
        ],
    )


def _check_record(rec: wire.PeerRecord) -> None:
    ends = [(addr, addr + n) for addr, n, _ in rec.registrations]
    for r in rec.regions:
        if not any(a <= r.addr and r.addr + r.nbytes <= b for a, b in ends):
            raise Rejected(f"region {r.name!r} lies outside every registration")


def _run_record(data: bytes) -> None:
    _check_record(wire.decode_peer_record(data, None, NAMESPACE))


def _run_record_outsider(data: bytes) -> None:
    wire.decode_peer_record(data, SECRET, NAMESPACE)


def _record_body(rec: wire.PeerRecord) -> bytes:
    """The msgpack body inside a record's envelope (what the insider target seals)."""
    envelope = msgpack.unpackb(wire.encode_peer_record(rec), raw=False)
    body: bytes = envelope["body"]
    return body


def _run_record_insider(body: bytes) -> None:
    envelope = msgpack.packb(
        {"v": wire.FORMAT_VERSION, "kind": "peer", "body": KEYS.seal_record(body), "sealed": True},
        use_bin_type=True,
    )
    _check_record(wire.decode_peer_record(envelope, SECRET, NAMESPACE))


def _memory_map(rec: wire.PeerRecord) -> bytes:
    """A record's memory map, inflated (the region-table target compresses what it is given)."""
    packed = msgpack.unpackb(_record_body(rec), raw=False)["memory"]
    return zlib.decompress(packed)


def _run_region_table(table: bytes, compress: bool = True) -> None:
    data = zlib.compress(table, 1) if compress else table
    regs, regions = region_codec.decode_memory_map(
        data,
        wire._DTYPES,  # noqa: SLF001 (the record's own columns)
        wire.DTYPE_SIZES,
        wire.ACCESS_MODES,
        wire.MAX_REGION_NAME,
        wire.MAX_DIMS,
        RegionInfo,
    )
    for r in regions:
        if not any(a <= r.addr and r.addr + r.nbytes <= a + n for a, n, _ in regs):
            raise Rejected(f"region {r.name!r} lies outside every registration")


def _run_heartbeat(data: bytes) -> None:
    generation, when = wire.decode_heartbeat(data)
    if type(generation) is not int or type(when) is not float:
        raise Rejected("a heartbeat decoded into the wrong types")


def _run_frame(data: bytes) -> None:
    """A notification as a receiver's engine reads it: split, then its channel's message."""
    tag, channel, payload = wire.parse_notification(data)
    if channel == GROUP_CHANNEL:
        group_messages.decode(payload)
    elif channel == bucket_messages.CHANNEL:
        bucket_messages.decode(payload)


def _frame_seeds() -> list[bytes]:
    """Valid frames, and the edges: empty, a channel not in ASCII, one byte too long."""
    edges = [
        b"",
        bytes([wire.TAG_CONTROL, 3]) + b"a\xffb" + b"x",
        wire.frame_user_notification(b"u" * wire.MAX_NOTIFY_BYTES) + b"!",
    ]
    return edges + _valid_frames()


def _valid_frames() -> list[bytes]:
    return [
        wire.frame_user_notification(b"v7"),
        wire.frame_control(GROUP_CHANNEL, group_messages.encode(group_messages.Ver(3, 1))),
        wire.frame_control(bucket_messages.CHANNEL, bucket_messages.encode(_bucket_seed()[0])),
    ]


# --- sealed frames and signed store values -----------------------------------------------------

SENDER, RECEIVER = wire.agent_name("trainer", 3), wire.agent_name("gen-0", 7)
_SEQ = struct.Struct(">Q")


def _run_sealed_frame_outsider(data: bytes) -> None:
    FrameOpener(KEYS, RECEIVER).open(SENDER, data)


def _run_sealed_frames_insider(data: bytes) -> None:
    """Frames sealed with the right MAC, their sequence numbers the fuzzer's: the input is a
    series of (8-byte sequence number, 1-byte length, frame) that one receiver opens in turn
    (its replay window decides each); what opens is then parsed as a notification."""
    opener = FrameOpener(KEYS, RECEIVER)
    mac = KEYS.frame_mac(SENDER, RECEIVER)
    pos = 0
    while pos + 9 <= len(data):
        seq, n = data[pos : pos + 8], data[pos + 8]
        frame = data[pos + 9 : pos + 9 + n]
        pos += 9 + n
        h = mac.copy()
        h.update(seq)
        h.update(frame)
        try:
            opened = opener.open(SENDER, frame + seq + h.digest())
        except sealing.SignatureError:
            continue  # a replay or an empty frame: refused, the next one is still read
        if opened != frame:
            raise Rejected("a sealed frame opened into other bytes")
        if opened:
            try:
                _run_frame(opened)
            except WireFormatError:
                pass


def _insider_frame_seeds() -> list[bytes]:
    out = b""
    base = sealing.sequence_base()
    for i, frame in enumerate(_valid_frames()[:2]):
        out += _SEQ.pack(base + i) + bytes([len(frame)]) + frame
    replay = out[: 9 + out[8]]  # the first frame again: refused
    return [out, out + replay]


def _run_signed(data: bytes) -> None:
    """A store value as each reader reads it: without a secret, with one (the outsider's
    value: no mutation gets past the MAC), and as an inspector (the MAC not looked at)."""
    for keys, verify in ((None, True), (KEYS, True), (KEYS, False)):
        try:
            _check_signed(signed.decode(keys, "transport/ns/k", data, "a value", verify))
        except WireFormatError:
            pass


def _check_signed(value: signed.SignedValue) -> None:
    if not (
        isinstance(value.body, bytes) and type(value.generation) is int and value.generation > 0
    ):
        raise Rejected("a signed value decoded into the wrong types")
    if not wire.NAME_RE.fullmatch(value.writer):
        raise Rejected(f"a signed value names writer {value.writer!r}")


def _signed_seeds() -> list[bytes]:
    return [
        signed.encode(None, "transport/ns/k", "gen-1", 3, b"body"),
        signed.encode(None, "transport/ns/k", "trainer", 1, b""),
        signed.encode(KEYS, "transport/ns/k", "gen-1", 3, b"body"),
    ]


# --- weight-sync messages ----------------------------------------------------------------------


def _group_seeds() -> list[bytes]:
    m = group_messages
    targets = (m.Target("gen-1", 0, True, 4), m.Target("gen-2", 1, False))
    return [
        m.encode(msg)
        for msg in (
            m.Hello(),
            m.Begin(9, 1),
            m.Ver(9, 0),
            m.Abort(9, 1),
            m.Lend(9),
            m.Credit((0, 1), 8, 7, (5, 6)),
            m.Forward(9, 1000, targets),
            m.Segment(9, 0, 2, 5),
            m.PartLanded(9, 0, 2, 4096, 8192),
            m.Patch(9, 1, 8, 4096, 64),
            m.Patched(9, 1, ""),
            m.Report(9, "gen-1", "fail", "why"),
            m.Report(9, "gen-2", "", "", 4096),
        )
    ]


def _bucket_seed() -> list[Any]:
    b = bucket_messages
    token = "0123456789abcdef"
    return [
        b.Bucket(token, 3, 1, 1 << 20, 4096, 512, False, 0),
        b.Bucket(token, 4, 0, 100, 0, 64, True, 80),
        b.Free(token, 3),
        b.Begun(token),
        b.Stop(token, "the trainer rank died", True),
    ]


def _run_codec(codec: message_codec.Codec[Any], data: bytes) -> None:
    msg = codec.decode(data)
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if type(v) is int and not -1 <= v < 1 << 63:
                raise Rejected(f"{msg.KIND}.{f.name} was accepted as {value!r}")
    if codec.decode(codec.encode(msg)) != msg:
        raise Rejected(f"a {msg.KIND} message does not survive its own trip")


def _run_withdraw(data: bytes) -> None:
    w = Withdraw.decode(data)
    if Withdraw.decode(w.encode()) != w:
        raise Rejected("a withdraw message does not survive its own trip")


def _withdraw_seeds() -> list[bytes]:
    return [
        Withdraw("withdraw", ("layers.0.w", "layers.1.w"), 7, 12).encode(),
        Withdraw("dropped", ("a",), 3).encode(),
    ]


# --- delta blobs -------------------------------------------------------------------------------


def _delta_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "a.bf16": torch.randn(300, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(200, generator=g),
        "c.i8": torch.randint(-100, 100, (97,), generator=g, dtype=torch.int8),
        "d.f64": torch.randn(33, generator=g, dtype=torch.float64),
    }


_DELTA_BASE = _delta_tensors()
_DELTA_LAYOUT = DeltaLayout(_DELTA_BASE)
_GUARD = torch.full((64,), 0xA5, dtype=torch.uint8)
#: where each tensor starts in the flat buffer the blob is applied onto (8-byte aligned)
_DELTA_AT = [
    sum(-(-v.numel() * v.element_size() // 8) * 8 for v in list(_DELTA_BASE.values())[:i])
    for i in range(len(_DELTA_BASE))
]
_DELTA_BYTES = _DELTA_AT[-1] + -(-list(_DELTA_BASE.values())[-1].nbytes // 8) * 8


def _delta_seeds() -> list[bytes]:
    out = []
    for share in (0.0, 0.01, 0.3, 1.0):
        g = torch.Generator().manual_seed(int(share * 100))
        cur = {}
        for k, v in _DELTA_BASE.items():
            bits = v.clone().view(torch.uint8)
            pick = torch.rand(bits.numel(), generator=g) < share
            bits[pick] ^= 0x5A
            cur[k] = bits.view(v.dtype)
        base = {k: v.clone() for k, v in _DELTA_BASE.items()}
        enc = delta_encode(_DELTA_LAYOUT, cur, base, 7, 6)
        assert enc is not None
        out.append(enc.blob.numpy().tobytes())
    return out


def _run_delta(data: bytes) -> None:
    """A blob as a subscriber decodes and applies it: onto views of one flat buffer, whose
    last bytes (past every tensor) must stay as they were."""
    blob = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    decoded = delta_decoder.decode(_DELTA_LAYOUT, blob, 7, 6)
    flat = torch.full((_DELTA_BYTES + _GUARD.numel(),), 0xA5, dtype=torch.uint8)
    targets = {}
    for (k, v), at in zip(_DELTA_BASE.items(), _DELTA_AT, strict=True):
        n = v.numel() * v.element_size()
        flat[at : at + n] = v.view(torch.uint8)
        targets[k] = flat[at : at + n].view(v.dtype)
    at = _DELTA_BYTES
    delta_decoder.apply(decoded, targets)
    if not torch.equal(flat[at:], _GUARD):
        raise Rejected("applying a delta wrote past its tensors")


# --- store values: leases, group entries, counters, layouts -------------------------------------

_LEASE_KEY = "transport/ns/groups/policy/lease/0"


def _run_lease(body: bytes) -> None:
    """A lease body, signed by its writer (the insider's view: the envelope holds)."""
    store = SignedStore(MemoryStore(), None, "trainer", 3)
    got = lease.decode_lease(store, _LEASE_KEY, store.encode(_LEASE_KEY, body), 0)
    if (got.name, got.generation, got.rank) != ("trainer", 3, 0) or got.world < 1:
        raise Rejected(f"a lease of another writer or rank was taken: {got}")


def _lease_seeds() -> list[bytes]:
    return [
        lease.Lease("trainer", 3).encode(),
        lease.Lease("trainer", 3, 0, 4, "a" * 64).encode(),
    ]


_ENTRY_WRITER = "gen-1"


def _run_group_entry(body: bytes) -> None:
    """A subscriber's group entry as a publisher reads it from the store."""
    store = MemoryStore()
    writer = SignedStore(store, None, _ENTRY_WRITER, 3)
    directory = group_directory.GroupDirectory(writer, NAMESPACE, "policy")
    writer.set(directory.prefix + f"sub/{_ENTRY_WRITER}", body)
    entry = directory.entry(_ENTRY_WRITER)
    if entry is not None and not (
        entry.generation == 3 and entry.slots in (1, 2) and entry.mode in group_directory.MODES
    ):
        raise Rejected(f"a malformed group entry was taken: {entry}")


def _group_entry_seeds() -> list[bytes]:
    store = MemoryStore()
    writer = SignedStore(store, None, _ENTRY_WRITER, 3)
    directory = group_directory.GroupDirectory(writer, NAMESPACE, "policy", instance=5)
    out = []
    for mode, slots, relay in (("staging", 2, False), (group_directory.MODES[-1], 1, True)):
        directory.join(mode, slots, relay)
        value = writer.get(directory.prefix + f"sub/{_ENTRY_WRITER}", "entry")
        assert value is not None
        out.append(value.body)
    return out


def _run_counter(data: bytes) -> None:
    n = Counter(MemoryStore(), "k", "a counter").parse(data)
    if n is not None and not (type(n) is int and n >= 0):
        raise Rejected(f"a counter read as {n!r}")


def _run_layout(data: bytes) -> None:
    dest = layout_encoding.decode_dest(data)
    sources = layout_encoding.decode_sources(data)
    if layout_encoding.decode_dest(layout_encoding.encode_dest(dest, sources)) != dest:
        raise Rejected("a declared layout does not survive its own trip")


def _layout_seeds() -> list[bytes]:
    from transport.weights import SourceLayout, fp8, full_copy, tp_shard

    src = SourceLayout.split(
        2,
        {
            "q": ((64, 32), torch.float32),
            "k": ((32, 32), torch.float32),
            "n": ((32,), torch.float32),
        },
        {"n": None},
    )
    lay = {"qk": tp_shard(src, "qk", ["q", "k"], 0, 2, 1), **full_copy(src, ["n"], {"n2": "n"})}
    quant = fp8(full_copy(src, ["q"]), block=(16, 16))
    return [
        layout_encoding.encode_dest(lay),
        layout_encoding.encode_dest(quant, {"q": (64, 32)}),
    ]


# --- torch's transport API descriptors -----------------------------------------------------------


def _run_torch_api(data: bytes) -> None:
    from transport.integrations.torch_api.descriptors import EndpointUrl, RemoteRegion

    for decode in (EndpointUrl.decode, RemoteRegion.deserialize):
        try:
            got = decode(data)
        except ValueError:
            continue
        if not (isinstance(got.record, bytes) and type(got.generation) is int):
            raise Rejected(f"a descriptor decoded into the wrong types: {got!r}")


def _torch_api_seeds() -> list[bytes]:
    from transport.integrations.torch_api.descriptors import EndpointUrl, RemoteRegion

    record = wire.encode_peer_record(_record(2))
    return [
        EndpointUrl("gen-0", 7, record).encode(),
        RemoteRegion("gen-0", 7, "layers.0.w", 4096, record).serialize(),
    ]


# --- vLLM's and verl's messages ------------------------------------------------------------------


def _well_typed(obj: Any, cls: type) -> None:
    """Every field of a parsed dataclass holds a value of its annotation."""
    hints = {
        "str": str,
        "int": int,
        "float": (int, float),
        "bool": bool,
        "str | None": (str, type(None)),
        "int | None": (int, type(None)),
        "float | None": (int, float, type(None)),
        "list[str]": (list, str),
    }
    for f in dataclasses.fields(cls):
        want = hints.get(str(f.type))
        value = getattr(obj, f.name)
        if want is None:
            continue
        if not isinstance(value, want) or (want in (int, (int, type(None))) and value is True):
            raise Rejected(f"{cls.__name__}.{f.name} was accepted as {value!r}")
        if f.type == "list[str]" and not isinstance(value, list | str):
            raise Rejected(f"{cls.__name__}.{f.name} was accepted as {value!r}")
        if f.type == "list[str]" and not all(isinstance(v, str) for v in value):
            raise Rejected(f"{cls.__name__}.{f.name} was accepted as {value!r}")


def _run_vllm_infos(data: bytes) -> None:
    from transport.integrations.vllm.infos import TransportInitInfo, TransportUpdateInfo, parse

    try:
        given = json.loads(data)
    except (ValueError, RecursionError):
        return  # vLLM parses the JSON; our code sees only what parsed
    for cls, what in ((TransportInitInfo, "init_info"), (TransportUpdateInfo, "update_info")):
        try:
            info = parse(cls, given, what)
        except ValueError:
            continue
        _well_typed(info, cls)


def _vllm_infos_seeds() -> list[bytes]:
    return [
        json.dumps(
            {"store": "tcp://10.0.0.1:29500", "namespace": "run-7", "mode": "sharded"}
        ).encode(),
        json.dumps(
            {
                "store": "redis://h:6379/0",
                "adapter": "math",
                "rank": 8,
                "alpha": 16.0,
                "targets": ["q_proj", "v_proj"],
                "staging_slots": 2,
                "staging_gb": 1.5,
                "delta": True,
            }
        ).encode(),
        json.dumps({"version": 3, "timeout": 30.0, "abandon": False}).encode(),
    ]


def _run_lora_route(data: bytes) -> None:
    from transport.integrations.vllm.lora_routes import AdapterCall

    call = AdapterCall.parse("load", data)
    _well_typed(call, AdapterCall)


def _lora_route_seeds() -> list[bytes]:
    return [
        json.dumps(
            {"adapter": "math", "namespace": "t1", "version": 4, "timeout": 30, "proof": "ab"}
        ).encode(),
        json.dumps({"adapter": "x", "as_model": True}).encode(),
        # the edges: each field of another type
        json.dumps({"adapter": "x", "version": -1}).encode(),
        json.dumps({"adapter": "x", "timeout": True}).encode(),
        json.dumps({"adapter": "x", "proof": 5}).encode(),
        json.dumps({"adapter": "x", "as_model": "yes"}).encode(),
    ]


_INFO_FIELDS = [f.name for f in dataclasses.fields(topology.EngineInfo)]


def _run_verl_topology(data: bytes) -> None:
    """verl's driver building every engine's plan from their introductions: the input is a
    msgpack [trainers, rollouts, [introduction, ...]], each introduction a list of
    EngineInfo's fields."""
    try:
        m = msgpack.unpackb(data, raw=False, max_array_len=64, max_map_len=0, max_str_len=256)
    except Exception:
        return
    if not (isinstance(m, list) and len(m) == 3 and isinstance(m[2], list)):
        return
    trainers, rollouts, given = m
    if not (type(trainers) is int and type(rollouts) is int and -2 < trainers + rollouts < 64):
        return
    infos = []
    for g in given:
        if not isinstance(g, list) or len(g) > len(_INFO_FIELDS):
            return
        infos.append(topology.EngineInfo(*g))
    plans = topology.build_plans(trainers, rollouts, infos)
    for plan in (*plans[0], *plans[1]):
        for target in plan.targets:
            if target == plan.store or target not in {i.name for i in infos}:
                raise Rejected(f"a plan writes {target!r}, which is no engine")


def _verl_seeds() -> list[bytes]:
    def intro(name: str, store: str | None, degree: int | None = None) -> list[Any]:
        return [name, store, 1 << 20, degree, False, ""]

    return [
        msgpack.packb([1, 2, [intro("t0", "tcp://h:1"), intro("r0", None), intro("r1", None)]]),
        msgpack.packb(
            [
                2,
                5,
                [intro("t0", "tcp://h:1", 2), intro("t1", None, 2)]
                + [intro(f"r{i}", None, 2) for i in range(5)],
            ]
        ),
    ]


# --- the registry ------------------------------------------------------------------------------


def _decoders(*objs: object) -> tuple[object, ...]:
    return objs


# --- the CMA identity at the head of a peer's backend metadata -----------------------------------


def _run_cma_identity(data: bytes) -> None:
    ident, rest = cma.Identity.split(data)
    if ident is None:
        if rest is not data:
            raise Rejected("metadata without an identity must pass on as it came")
        return
    if cma.Identity.split(ident.encode() + rest) != (ident, rest) or ident.pid <= 0:
        raise Rejected("an accepted identity must read back the same from its own encoding")
    if len(ident.token) != cma.TOKEN_BYTES:
        raise Rejected("an accepted identity carries a whole token")


def _cma_seeds() -> list[bytes]:
    ident = cma.Identity(4321, 7, 4026531840, 0x7F0000001000, bytes(range(16)))
    return [ident.encode() + b"nixl-metadata", ident.encode(), b"nixl-metadata-without-one"]


TARGETS: tuple[Target, ...] = (
    Target(
        "peer_record",
        _run_record,
        (WireFormatError,),
        lambda: [wire.encode_peer_record(_record(n)) for n in (0, 1, 2, 6)],
        _decoders(
            wire.decode_peer_record,
            wire._record_body,  # noqa: SLF001
            wire._check_fields,  # noqa: SLF001
            wire.unpack,
            Bell.unpack,
        ),
        budget=64 * MiB,
    ),
    Target(
        "peer_record_outsider",
        _run_record_outsider,
        (WireFormatError,),
        lambda: [wire.encode_peer_record(_record(), SECRET), wire.encode_peer_record(_record())],
        _decoders(wire._record_body, sealing.Keys.open_record),  # noqa: SLF001
        budget=64 * MiB,
    ),
    Target(
        "peer_record_insider",
        _run_record_insider,
        (WireFormatError,),
        lambda: [_record_body(_record(n)) for n in (1, 6)] + [_record_body(_record(3, "cuda:1"))],
        _decoders(wire.decode_peer_record, wire._record_body),  # noqa: SLF001
        budget=64 * MiB,
    ),
    Target(
        "region_table",
        _run_region_table,
        (WireFormatError,),
        lambda: [_memory_map(_record(n)) for n in (0, 1, 6)] + [_memory_map(_record(2, "cuda:0"))],
        _decoders(region_codec),
        budget=64 * MiB,
    ),
    Target(
        "region_table_zlib",
        lambda data: _run_region_table(data, compress=False),
        (WireFormatError,),
        lambda: [zlib.compress(_memory_map(_record(n))) for n in (1, 6)],
        _decoders(region_codec.inflate, region_codec._pieces, region_codec._inflate_exact),  # noqa: SLF001
        budget=64 * MiB,
    ),
    Target(
        "heartbeat",
        _run_heartbeat,
        (WireFormatError,),
        lambda: [wire.encode_heartbeat(7, 12345.5), wire.encode_heartbeat(1, 0.0)],
        _decoders(wire.decode_heartbeat),
    ),
    Target(
        "notification_frame",
        _run_frame,
        (WireFormatError,),
        _frame_seeds,
        _decoders(wire.parse_notification),
    ),
    Target(
        "sealed_frame_outsider",
        _run_sealed_frame_outsider,
        (WireFormatError,),
        lambda: [KEYS.sealer(SENDER, RECEIVER).seal(f) for f in _valid_frames()],
        _decoders(FrameOpener.open),
    ),
    Target(
        "sealed_frames_insider",
        _run_sealed_frames_insider,
        (),
        _insider_frame_seeds,
        _decoders(FrameOpener, sealing._Window),  # noqa: SLF001
    ),
    Target(
        "signed_value",
        _run_signed,
        (),
        _signed_seeds,
        _decoders(signed.decode),
    ),
    Target(
        "group_message",
        lambda data: _run_codec(group_messages.CODEC, data),
        (WireFormatError,),
        _group_seeds,
        _decoders(group_messages, message_codec.Codec.decode, message_codec._checked),  # noqa: SLF001
    ),
    Target(
        "bucket_message",
        lambda data: _run_codec(bucket_messages.CODEC, data),
        (WireFormatError,),
        lambda: [bucket_messages.encode(m) for m in _bucket_seed()],
        _decoders(bucket_messages),
    ),
    Target(
        "withdraw",
        _run_withdraw,
        (WireFormatError,),
        _withdraw_seeds,
        _decoders(Withdraw),
    ),
    Target(
        "delta_blob",
        _run_delta,
        (WireFormatError,),
        _delta_seeds,
        _decoders(delta_decoder),
        budget=64 * MiB,
    ),
    Target(
        "lease",
        _run_lease,
        (WireFormatError,),
        _lease_seeds,
        _decoders(lease.Lease.decode, lease.decode_lease),
    ),
    Target(
        "group_entry",
        _run_group_entry,
        (),
        _group_entry_seeds,
        _decoders(group_directory.GroupDirectory.entry, group_directory.GroupDirectory._entry_of),  # noqa: SLF001
    ),
    Target(
        "counter",
        _run_counter,
        (),
        lambda: [b"0", b"17", b"1234567890123"],
        _decoders(Counter.parse),
    ),
    Target(
        "declared_layout",
        _run_layout,
        (WireFormatError,),
        _layout_seeds,
        _decoders(
            layout_encoding.decode_dest,
            layout_encoding.decode_sources,
            layout_encoding._dest,  # noqa: SLF001
            layout_encoding._name,  # noqa: SLF001
        ),
    ),
    Target(
        "torch_api_descriptor",
        _run_torch_api,
        (),
        _torch_api_seeds,
        ("transport.integrations.torch_api.descriptors",),
        budget=64 * MiB,
    ),
    Target(
        "vllm_infos",
        _run_vllm_infos,
        (),
        _vllm_infos_seeds,
        (
            "transport.integrations.vllm.infos:parse",
            "transport.integrations.vllm.infos:_number",
            "transport.integrations.vllm.infos:TransportInitInfo.__post_init__",
            "transport.integrations.vllm.infos:TransportUpdateInfo.__post_init__",
        ),
    ),
    Target(
        "lora_route",
        _run_lora_route,
        (RouteError,),
        _lora_route_seeds,
        ("transport.integrations.vllm.lora_routes:AdapterCall.parse",),
    ),
    Target(
        "verl_topology",
        _run_verl_topology,
        (ValueError, TypeError),
        _verl_seeds,
        _decoders(topology.build_plans),
    ),
    Target(
        "cma_identity",
        _run_cma_identity,
        (WireFormatError,),
        _cma_seeds,
        _decoders(cma.Identity.split),
    ),
)


def _selftest_error(data: bytes) -> None:
    if len(data) > 2 and data[2] == 0xFF:
        raise KeyError("a decoder's bug")


def _selftest_budget(data: bytes) -> None:
    if len(data) > 8:
        bytearray(len(data) * MiB)


def _selftest_hang(data: bytes) -> None:
    while len(data) > 4:
        pass


#: targets with a planted finding, never in TARGETS: the runner must report each
SELFTESTS: tuple[Target, ...] = (
    Target("selftest_error", _selftest_error, (WireFormatError,), lambda: [b"ab"], ()),
    Target("selftest_budget", _selftest_budget, (), lambda: [b"ab"], (), budget=4 * MiB),
    Target("selftest_hang", _selftest_hang, (), lambda: [b"ab"], ()),
)

BY_NAME = {t.name: t for t in (*TARGETS, *SELFTESTS)}
#: what some targets import on their first input (vLLM takes seconds): the runner imports them
#: first, under instrumentation, when it runs those targets
LAZY = {
    "torch_api_descriptor": "transport.integrations.torch_api.descriptors",
    "vllm_infos": "transport.integrations.vllm.infos",
    "lora_route": "transport.integrations.vllm.lora_routes",
}


def lines_of(obj: object) -> tuple[str, set[int] | None]:
    """The file of ``obj`` and the lines it spans (None: the whole module)."""
    import importlib
    import inspect

    if isinstance(obj, str):
        module_name, _, qual = obj.partition(":")
        found: Any = importlib.import_module(module_name)
        for part in qual.split(".") if qual else ():
            found = getattr(found, part)
        obj = found
    if isinstance(obj, types.ModuleType):
        return str(obj.__file__), None
    obj = inspect.unwrap(getattr(obj, "__func__", obj))  # type: ignore[arg-type]
    source, first = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    return str(inspect.getsourcefile(obj)), set(range(first, first + len(source)))  # type: ignore[arg-type]


def measured(target: Target) -> list[tuple[str, set[int] | None]]:
    return [lines_of(obj) for obj in target.code]


def names(selected: Sequence[str] | None) -> list[Target]:
    if not selected:
        return list(TARGETS)
    unknown = sorted(set(selected) - set(BY_NAME))
    if unknown:
        raise SystemExit(f"unknown fuzz targets {unknown}; the targets are {sorted(BY_NAME)}")
    return [BY_NAME[n] for n in selected]
