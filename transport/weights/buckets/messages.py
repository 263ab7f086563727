"""The bucket protocol's control messages as typed values, and their one encoder and decoder.

Every message names the update it belongs to (``token``: minted once per update by
:func:`~transport.weights.buckets.topology.build_plans`), so a message of an earlier update
that arrives late is told apart and ignored. On the wire a message is a msgpack map with its kind
under ``"kind"``; :func:`decode` is the only place that reads a peer's bytes (exact field sets,
types and ranges, or :class:`~transport.errors.WireFormatError`).

* :class:`Bucket` (sender -> receiver, the notification of the bucket's put): bucket ``index`` of
  the update has landed in ``slot``; its tensors' metadata lies in the bucket itself at
  ``header_at`` (``header_bytes`` long), after its data; ``changes`` > 0: instead of its data
  (``data_bytes``, as the header lays it out) the bucket holds that many bytes of its changes
  (changes.py).
* :class:`Free` (receiver -> the sender of bucket ``index``): my slot ``index % 2`` may take
  bucket ``index`` (I am done with bucket ``index - 2``: yielded, and relayed to my children).
* :class:`Abort` (anyone -> the others): I stop this update, because of ``reason``; ``whole``
  says that the update cannot complete anywhere (a trainer rank is gone), not only here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import msgpack

from transport import WireFormatError
from transport.contract import unpack

#: the control channel of the bucket protocol (one per Transport: an engine owns its Transport)
CHANNEL = "verl/buckets"
#: an update's token: this many hex digits
TOKEN_CHARS = 16
MAX_REASON = 4096
_TOKEN_OK = set("0123456789abcdef")


@dataclass(frozen=True)
class Bucket:
    """Bucket ``index`` of update ``token`` has landed in ``slot``; ``last``: no bucket follows;
    ``changes``: bytes of its changes at its start (0: its data, raw)."""

    KIND: ClassVar[str] = "bucket"
    token: str
    index: int
    slot: int
    data_bytes: int
    header_at: int
    header_bytes: int
    last: bool
    changes: int = 0


@dataclass(frozen=True)
class Free:
    """The receiver's slot ``index % 2`` may take bucket ``index`` of update ``token``."""

    KIND: ClassVar[str] = "free"
    token: str
    index: int


@dataclass(frozen=True)
class Abort:
    """The sender of this message stops update ``token`` because of ``reason``; ``whole``: the
    update cannot complete on any worker."""

    KIND: ClassVar[str] = "abort"
    token: str
    reason: str
    whole: bool


Message = Bucket | Free | Abort
KINDS: dict[str, type[Bucket] | type[Free] | type[Abort]] = {
    cls.KIND: cls for cls in (Bucket, Free, Abort)
}
_INTS = ("index", "slot", "data_bytes", "header_at", "header_bytes", "changes")


def encode(msg: Message) -> bytes:
    """The wire form of ``msg``."""
    return msgpack.packb({"kind": msg.KIND, **asdict(msg)})


def decode(payload: bytes) -> Message:
    """A peer's bytes as a message, or WireFormatError naming the broken rule."""
    m: Any = unpack(
        payload, "bucket-protocol message", 8192, max_str=MAX_REASON, max_array=0, max_map=10
    )
    kind = m.get("kind") if isinstance(m, dict) else None
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise WireFormatError(f"unknown bucket-protocol message {str(m)[:80]}")
    names = {f.name for f in fields(cls)}
    if set(m) != names | {"kind"}:
        raise WireFormatError(
            f"a {kind!r} message has the fields {sorted(names)}, got {sorted(set(m) - {'kind'})}"
        )
    raw = {name: m[name] for name in names}
    token = raw["token"]
    if not isinstance(token, str) or len(token) != TOKEN_CHARS or not set(token) <= _TOKEN_OK:
        raise WireFormatError(f"an update token is {TOKEN_CHARS} hex digits, got {token!r}")
    for name in _INTS:
        if name in raw and (type(raw[name]) is not int or raw[name] < 0):
            raise WireFormatError(f"field {name!r} of a {kind!r} message must be an int >= 0")
    for name in ("last", "whole"):
        if name in raw and type(raw[name]) is not bool:
            raise WireFormatError(f"field {name!r} of a {kind!r} message must be a bool")
    if "reason" in raw and not isinstance(raw["reason"], str):
        raise WireFormatError("an abort's reason must be a str")
    if cls is Bucket and raw["slot"] > 1:
        raise WireFormatError(f"a bucket's slot is 0 or 1, got {raw['slot']}")
    return cls(**raw)
