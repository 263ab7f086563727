"""The bucket protocol's control messages as typed values, encoded and decoded by the one codec
of weight sync (weights/message_codec.py: its kind under ``"k"``, short keys for the fields).

Every message names the update it belongs to (``token``: minted once per update by
:func:`~transport.weights.buckets.topology.build_plans`), so a message of an earlier update
that arrives late is told apart and ignored. :func:`decode` is the only place that reads a
peer's bytes (exact field sets, types and ranges, or :class:`~transport.errors.WireFormatError`).

* :class:`Bucket` (sender -> receiver, the notification of the bucket's put): bucket ``index`` of
  the update has landed in ``slot``; its tensors' metadata lies in the bucket itself at
  ``header_at`` (``header_bytes`` long), after its data; ``changes`` > 0: instead of its data
  (``data_bytes``, as the header lays it out) the bucket holds that many bytes of its changes
  (changes.py).
* :class:`Free` (receiver -> the sender of bucket ``index``): my slot ``index % 2`` may take
  bucket ``index`` (I am done with bucket ``index - 2``: yielded, and relayed to my children);
  a numbered slot credit (weights/slot_credits.py). The first two, ``Free(0)`` and ``Free(1)``,
  go once the receiver began the update and every writer of it said :class:`Begun`.
* :class:`Begun` (writer -> its targets, at the start of each update): I began update
  ``token``; no put of an earlier update of mine is in flight, and none will start.
* :class:`Stop` (anyone -> the others): I stop this update, because of ``reason``; ``whole``
  says that the update cannot complete anywhere (a trainer rank is gone), not only here. Not
  a weight group's ``Abort``, which gives up one write into one slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from transport.weights.message_codec import Codec

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
    WIRE: ClassVar[dict[str, str]] = {
        "token": "t",
        "index": "i",
        "slot": "s",
        "data_bytes": "n",
        "header_at": "h",
        "header_bytes": "hn",
        "last": "l",
        "changes": "c",
    }
    token: str
    index: int
    slot: int
    data_bytes: int
    header_at: int
    header_bytes: int
    last: bool
    changes: int = 0

    def wire_rule(self) -> str:
        if self.slot > 1:
            return f"a bucket's slot is 0 or 1, got {self.slot}"
        return token_rule(self.token)


@dataclass(frozen=True)
class Free:
    """The receiver's slot ``index % 2`` may take bucket ``index`` of update ``token``."""

    KIND: ClassVar[str] = "free"
    WIRE: ClassVar[dict[str, str]] = {"token": "t", "index": "i"}
    token: str
    index: int

    def wire_rule(self) -> str:
        return token_rule(self.token)


@dataclass(frozen=True)
class Begun:
    """The sender began update ``token``: every put it started for an earlier update has
    settled, and it starts none again."""

    KIND: ClassVar[str] = "begun"
    WIRE: ClassVar[dict[str, str]] = {"token": "t"}
    token: str

    def wire_rule(self) -> str:
        return token_rule(self.token)


@dataclass(frozen=True)
class Stop:
    """The sender of this message stops update ``token`` because of ``reason``; ``whole``: the
    update cannot complete on any worker."""

    KIND: ClassVar[str] = "stop"
    WIRE: ClassVar[dict[str, str]] = {"token": "t", "reason": "e", "whole": "w"}
    token: str
    reason: str
    whole: bool

    def wire_rule(self) -> str:
        return token_rule(self.token)


def token_rule(token: str) -> str:
    """The rule an update's token breaks ("" when it keeps them)."""
    if len(token) != TOKEN_CHARS or not set(token) <= _TOKEN_OK:
        return f"an update token is {TOKEN_CHARS} hex digits, got {token!r}"
    return ""


Message = Bucket | Free | Begun | Stop
#: the bucket protocol's codec (weights/message_codec.py)
CODEC: Codec[Message] = Codec(
    "bucket-protocol",
    (Bucket, Free, Begun, Stop),
    max_bytes=8192,
    max_str=MAX_REASON,
    max_array=0,
    max_map=10,
)
encode = CODEC.encode
decode = CODEC.decode
