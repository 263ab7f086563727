"""Signed store values: whatever in the store decides where bytes land or who takes part.

Peer records are sealed whole (``wire.py``); the smaller values that the layers keep beside them
(heartbeats, a weight group's entries and declared layouts, publisher leases, rank counts, the
versions a rank published) are written through here. A stored value is an envelope::

    {"v": 1, "kind": "signed", "writer": <peer name>, "gen": <its generation>,
     "body": <bytes>, "mac": <16 bytes, or empty without a secret>}

With the namespace's secret the MAC (keyed BLAKE2b, ``Keys.value_mac``) covers the namespace, the
key the value is stored under, the writer's name and generation and the body: a process without
the secret can neither write a value that a reader accepts, nor move one to another key, nor
pass one off as another peer's or another incarnation's. What it can still do is delete values
and put back an older value of the same key (a replay): readers therefore check the writer
against whoever may write that key, and the writer's generation against its live incarnation
where that matters (a group entry of an older incarnation is not the subscriber's).

Without a secret the MAC is empty and every reader accepts the envelope: the store is then the
whole cluster's trust root (README, "Trust"). With a secret an envelope without a valid MAC is
refused with SignatureError, whoever wrote it, and the caller ignores the value and logs it.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from transport.errors import SignatureError, WireFormatError
from transport.security.sealing import MAC_BYTES, Keys
from transport.wire import NAME_RE, unpack

if TYPE_CHECKING:
    from transport.store.base import Store

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
#: the largest signed value: a declared layout of 262,144 tensors fits
MAX_VALUE_BYTES = 64 << 20
_FIELDS = frozenset({"v", "kind", "writer", "gen", "body", "mac"})
_MAX_GENERATION = (1 << 63) - 1


@dataclass(frozen=True)
class SignedValue:
    """A value read from the store and proven (with a secret) to be ``writer``'s, generation
    ``generation``, stored under the key it was read from. ``raw`` is the stored bytes (for a
    compare-and-set that replaces exactly this value)."""

    writer: str
    generation: int
    body: bytes
    raw: bytes


def encode(keys: Keys | None, key: str, writer: str, generation: int, body: bytes) -> bytes:
    """The stored form of ``body`` written by ``writer`` (of ``generation``) under ``key``."""
    mac = keys.value_mac(key, writer, generation, body) if keys is not None else b""
    out: bytes = msgpack.packb(
        {
            "v": ENVELOPE_VERSION,
            "kind": "signed",
            "writer": writer,
            "gen": generation,
            "body": body,
            "mac": mac,
        },
        use_bin_type=True,
    )
    return out


def decode(keys: Keys | None, key: str, raw: bytes, what: str, verify: bool = True) -> SignedValue:
    """The value stored under ``key`` (``what`` names it in errors): WireFormatError for a
    malformed envelope, SignatureError (with a secret) for one without a valid MAC. With
    ``verify=False`` the MAC is not looked at (an inspector's reading, never a decision)."""
    m = unpack(raw, what, MAX_VALUE_BYTES + 4096, max_str=MAX_VALUE_BYTES, max_array=0, max_map=8)
    if not isinstance(m, dict) or set(m) != _FIELDS:
        raise WireFormatError(f"{what} is not a signed store value (fields {sorted(_FIELDS)})")
    writer, gen, body, mac = m["writer"], m["gen"], m["body"], m["mac"]
    if (
        m["v"] != ENVELOPE_VERSION
        or m["kind"] != "signed"
        or not isinstance(writer, str)
        or not NAME_RE.fullmatch(writer)
        or type(gen) is not int
        or not 0 < gen <= _MAX_GENERATION
        or not isinstance(body, bytes)
        or not isinstance(mac, bytes)
    ):
        raise WireFormatError(f"{what} is a malformed signed store value")
    if not verify:
        pass
    elif keys is not None:
        if len(mac) != MAC_BYTES:
            raise SignatureError(
                f"{what} is not signed, but this namespace has a secret: it was written by a "
                "process without it (or by a Transport without secret=); ignored"
            )
        if not hmac.compare_digest(mac, keys.value_mac(key, writer, gen, body)):
            raise SignatureError(
                f"{what} does not carry a valid MAC for its key and writer {writer!r} (written "
                "without the namespace's secret, or moved from another key); ignored"
            )
    elif mac:
        raise SignatureError(
            f"{what} is signed with a secret, but this Transport has none; pass the namespace's "
            "secret="
        )
    return SignedValue(writer, gen, body, bytes(raw))


class SignedStore:
    """The signed values one Transport writes and reads (its name and generation are the writer
    of what it writes). It owns nothing but that identity and the keys; every call is one store
    round trip, as thread-safe as the store. :meth:`get` raises on a bad value; :meth:`read`
    ignores one (None) and logs why, for readers that must never be stopped by the store."""

    def __init__(self, store: Store, keys: Keys | None, writer: str, generation: int) -> None:
        self.store = store
        self.keys = keys
        self.writer = writer
        self.generation = generation

    def encode(self, key: str, body: bytes) -> bytes:
        return encode(self.keys, key, self.writer, self.generation, body)

    def set(self, key: str, body: bytes) -> bytes:
        """Write ``body`` under ``key``; the stored bytes."""
        raw = self.encode(key, body)
        self.store.set(key, raw)
        return raw

    def compare_set(self, key: str, expected: bytes | None, body: bytes) -> bool:
        """Write ``body`` under ``key`` if the stored bytes are ``expected`` (None: missing)."""
        return self.store.compare_set(key, expected, self.encode(key, body))

    def decode(self, key: str, raw: bytes, what: str) -> SignedValue:
        return decode(self.keys, key, raw, what)

    def get(self, key: str, what: str) -> SignedValue | None:
        """The value under ``key`` (None: missing); WireFormatError or SignatureError for a bad
        one."""
        raw = self.store.try_get(key)
        return None if raw is None else self.decode(key, raw, what)

    def read(self, key: str, what: str, writer: str | None = None) -> SignedValue | None:
        """The value under ``key`` if it is valid (and ``writer``'s, when given); None when it is
        missing, malformed, unsigned or another writer's, the last three logged as ignored."""
        try:
            value = self.get(key, what)
        except WireFormatError as e:
            log.warning("ignoring %s: %s", what, e)
            return None
        if value is not None and writer is not None and value.writer != writer:
            log.warning(
                "ignoring %s: written by %r, but only %r writes it", what, value.writer, writer
            )
            return None
        return value


class Inspector(SignedStore):
    """Reads a namespace's signed values as they are stored, without the secret: the envelope
    is checked, its MAC is not. For tools and tests that look at a store without a Transport;
    nothing the library decides reads through it, and it writes nothing (TypeError)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, None, "inspector", 1)

    def decode(self, key: str, raw: bytes, what: str) -> SignedValue:
        return decode(None, key, raw, what, verify=False)

    def set(self, key: str, body: bytes) -> bytes:
        raise TypeError(
            "an inspector of the store is read-only; write through transport.core.signed"
        )

    def compare_set(self, key: str, expected: bytes | None, body: bytes) -> bool:
        raise TypeError(
            "an inspector of the store is read-only; write through transport.core.signed"
        )
