"""The bytes that torch's transport API hands between processes, as this backend writes them.

Two kinds, each a versioned JSON envelope (``{"version": 1, "backend": "transport", "kind":
..., "fields": {...}}``, bytes fields in base64; no pickle, no class named by the payload):

* :class:`EndpointUrl` (what ``bind()`` returns and ``connect()`` takes): the engine's peer
  record as its store holds it, sealed with AES-GCM when a secret is set
  (transport/security/sealing.py), so a URL is useless to a process without the secret.
* :class:`RemoteRegion` (what ``Memory.to_remote_buffer()`` returns): the owner's engine, the
  region its registration is exposed as, its length, and the owner's record as it was then
  (sealed too): a peer that was connected before the region existed learns it from the
  descriptor itself, with no store between them.

A decoder checks the envelope, every field's type and range, and the size (a record is at
most ``MAX_RECORD_BYTES``); the record inside is checked (seal, namespace) only when it is
used, by the engine that admits it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, fields
from typing import Any

from transport.contract import MAX_RECORD_BYTES, NAME_RE, check_region_name

ENVELOPE_VERSION = 1
BACKEND = "transport"
#: a URL or descriptor is its record in base64 and a few names
MAX_ENVELOPE_BYTES = MAX_RECORD_BYTES * 4 // 3 + 4096


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate field {key!r}")
        out[key] = value
    return out


def _encode(kind: str, values: dict[str, Any]) -> bytes:
    encoded = {
        name: base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
        for name, value in values.items()
    }
    return json.dumps(
        {"version": ENVELOPE_VERSION, "backend": BACKEND, "kind": kind, "fields": encoded},
        separators=(",", ":"),
        allow_nan=False,
    ).encode("ascii")


def _decode(kind: str, data: object, types: dict[str, type]) -> dict[str, Any]:
    """The fields of an envelope of ``kind``, each of its declared type (ValueError otherwise)."""
    what = f"a {kind} of the transport backend"
    if not isinstance(data, bytes):
        raise TypeError(f"{what} is bytes, not {type(data).__name__}")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ValueError(f"{what} is at most {MAX_ENVELOPE_BYTES} bytes; got {len(data)}")
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if not isinstance(value, dict) or set(value) != {"version", "backend", "kind", "fields"}:
        raise ValueError(f"{what} must be an envelope of version, backend, kind and fields")
    if value["version"] != ENVELOPE_VERSION or type(value["version"]) is not int:
        raise ValueError(
            f"{what} has version {value['version']!r}; this library reads version "
            f"{ENVELOPE_VERSION} (upgrade both ends to one release)"
        )
    if value["backend"] != BACKEND:
        raise ValueError(
            f"these bytes belong to backend {value['backend']!r}, not {BACKEND!r}: both "
            "endpoints must use the same backend"
        )
    if value["kind"] != kind:
        raise ValueError(f"these bytes are a {value['kind']!r}, not a {kind}")
    body = value["fields"]
    if not isinstance(body, dict) or set(body) != set(types):
        raise ValueError(f"{what} has fields {sorted(types)}")
    out: dict[str, Any] = {}
    for name, kind_of in types.items():
        field_value = body[name]
        if kind_of is bytes:
            if not isinstance(field_value, str):
                raise ValueError(f"field {name!r} of {what} must be base64 text")
            try:
                field_value = base64.b64decode(field_value, validate=True)
            except binascii.Error:
                raise ValueError(f"field {name!r} of {what} is not base64") from None
        elif type(field_value) is not kind_of:
            raise ValueError(f"field {name!r} of {what} must be {kind_of.__name__}")
        out[name] = field_value
    return out


def _check_owner(owner: str, generation: int, record: bytes) -> None:
    if not NAME_RE.match(owner):
        raise ValueError(f"owner {owner[:80]!r} is not a peer name")
    if generation < 1:
        raise ValueError(f"generation must be positive, got {generation}")
    if not record or len(record) > MAX_RECORD_BYTES:
        raise ValueError(f"a record is 1 to {MAX_RECORD_BYTES} bytes; got {len(record)}")


@dataclass(frozen=True)
class EndpointUrl:
    """What ``bind()`` returns: the engine ``owner`` (a peer name), its ``generation`` and its
    ``record`` (sealed with a secret)."""

    owner: str
    generation: int
    record: bytes

    def __post_init__(self) -> None:
        _check_owner(self.owner, self.generation, self.record)

    def encode(self) -> bytes:
        return _encode("endpoint", {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def decode(cls, data: object) -> EndpointUrl:
        return cls(**_decode("endpoint", data, {"owner": str, "generation": int, "record": bytes}))


@dataclass(frozen=True)
class RemoteRegion:
    """A registration of a peer, as ``Memory.to_remote_buffer()`` describes it: ``length`` bytes
    exposed as ``region`` by engine ``owner`` (generation ``generation``), whose ``record``
    (sealed with a secret) lists it. Writes land at its start; reads come from it.

    It is torch's ``RemoteBuffer``: :meth:`serialize` and :meth:`deserialize` are the bytes to
    hand to the peer; it pickles too. It grants access to that memory: give it only to peers
    that may write or read there."""

    owner: str
    generation: int
    region: str
    length: int
    record: bytes

    def __post_init__(self) -> None:
        _check_owner(self.owner, self.generation, self.record)
        check_region_name(self.region)
        if self.length < 1:
            raise ValueError(f"length must be positive, got {self.length}")

    def size(self) -> int:
        return self.length

    def serialize(self) -> bytes:
        return _encode("memory", {f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def deserialize(cls, data: bytes) -> RemoteRegion:
        types = {"owner": str, "generation": int, "region": str, "length": int, "record": bytes}
        return cls(**_decode("memory", data, types))

    def __repr__(self) -> str:
        return f"RemoteRegion({self.owner}#{self.generation} {self.region!r}, {self.length} bytes)"
