"""The control messages of weight sync as typed values, and the one encoder and decoder of them.

Both protocols declare their messages the same way and go through one :class:`Codec`: the
weight groups' (weights/group/messages.py) and the bucket stream's that verl's engine runs on
(weights/buckets/messages.py). A message is a frozen dataclass with its kind in ``KIND`` and the
wire key of each field in ``WIRE``; on the wire it is a msgpack map with its kind under ``"k"``
and each field under its key (short: a notification stays small).

:meth:`Codec.decode` is the only place that reads a peer's bytes, and checks them in one order:
the size and the msgpack (strict, size-limited), the kind, the exact set of keys, each field by
its annotation (``int``: a non-negative int, never a bool; ``bool``; ``str``), then the class's
own rules. A class whose fields need other checks (negative versions, lists, nested values)
builds itself with a ``from_wire(raw)`` classmethod; one with rules across fields says them in
a ``wire_rule()`` method (the broken rule, or ""). Anything else is a WireFormatError that
names the rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgpack

from transport import WireFormatError
from transport.contract import is_count, unpack

log = logging.getLogger(__name__)

#: the key of a message's kind on the wire
KIND_KEY = "k"


class WireMessage(Protocol):
    """What a message class declares: its kind and the wire key of each field."""

    KIND: ClassVar[str]
    WIRE: ClassVar[dict[str, str]]


M = TypeVar("M", bound=WireMessage)


def _wire_value(value: Any) -> Any:
    """A field's value as msgpack takes it: tuples as lists, nested values by their
    ``to_wire()``."""
    if hasattr(value, "to_wire"):
        return value.to_wire()
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    return value


def _type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")


def _checked(kind: str, key: str, annotation: Any, value: Any) -> Any:
    """``value`` of field ``key`` if its annotation's rule holds, else WireFormatError."""
    name = _type_name(annotation)
    if name == "int" and not is_count(value):
        raise WireFormatError(
            f"field {key!r} of a {kind!r} message must be a non-negative 64-bit int (0 to 2**63 - 1)"
        )
    if name == "bool" and type(value) is not bool:
        raise WireFormatError(f"field {key!r} of a {kind!r} message must be a bool")
    if name == "str" and not isinstance(value, str):
        raise WireFormatError(f"field {key!r} of a {kind!r} message must be a str")
    return value


class Codec(Generic[M]):
    """One protocol's messages: encodes any of them and decodes a peer's bytes into one (see the
    module docstring for the checks). Owns nothing but the protocol's kinds and its limits;
    ``what`` names the protocol in errors and logs."""

    def __init__(
        self,
        what: str,
        kinds: Iterable[type[M]],
        *,
        max_bytes: int,
        max_str: int,
        max_array: int,
        max_map: int,
    ) -> None:
        self.what = what
        self.kinds: dict[str, type[M]] = {cls.KIND: cls for cls in kinds}
        self._limits = {"max_str": max_str, "max_array": max_array, "max_map": max_map}
        self._max_bytes = max_bytes
        #: each kind's fields and their annotations, read once (decode runs per notification)
        self._types: dict[str, dict[str, Any]] = {}
        for cls in self.kinds.values():
            types = {f.name: f.type for f in fields(cls)}  # type: ignore[arg-type]
            if set(cls.WIRE) != set(types) or KIND_KEY in cls.WIRE.values():
                raise TypeError(f"{cls.__name__}.WIRE must give a key to each field, never 'k'")
            self._types[cls.KIND] = types

    def encode(self, msg: M) -> bytes:
        """The wire form of ``msg``."""
        out: dict[str, Any] = {KIND_KEY: msg.KIND}
        for name, key in msg.WIRE.items():
            out[key] = _wire_value(getattr(msg, name))
        packed: bytes = msgpack.packb(out, use_bin_type=True)
        return packed

    def decode(self, payload: bytes) -> M:
        """A peer's bytes as a message, or WireFormatError naming the broken rule."""
        m = unpack(payload, f"{self.what} message", self._max_bytes, **self._limits)
        kind = m.get(KIND_KEY) if isinstance(m, dict) else None
        cls = self.kinds.get(kind) if isinstance(kind, str) else None
        if cls is None or set(m) != set(cls.WIRE.values()) | {KIND_KEY}:
            raise WireFormatError(f"malformed {self.what} message {str(m)[:80]}")
        raw = {name: m[key] for name, key in cls.WIRE.items()}
        build = getattr(cls, "from_wire", None)
        if build is not None:
            msg: M = build(raw)
        else:
            types = self._types[cls.KIND]
            checked = {n: _checked(cls.KIND, cls.WIRE[n], types[n], v) for n, v in raw.items()}
            msg = cls(**checked)
        rule = getattr(msg, "wire_rule", None)
        broken = rule() if rule is not None else ""
        if broken:
            raise WireFormatError(broken)
        return msg

    def decode_from(self, peer: str, payload: bytes) -> M | None:
        """``payload`` of ``peer`` decoded, or None (logged) when it breaks a rule: one bad
        message never stops the peer that reads it."""
        try:
            return self.decode(payload)
        except WireFormatError as e:
            log.warning("dropping a %s message from %s: %s", self.what, peer, e)
            return None
