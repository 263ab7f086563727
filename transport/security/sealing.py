"""What a namespace's shared secret does: sealed peer records and authenticated notifications.

With ``secret=``, two keys are derived from the secret and the namespace (HKDF-SHA256, from
``cryptography``): one seals peer records with AES-256-GCM, so the NIXL connection metadata and
the memory map in them are useless to a process without the secret (it can neither load the
agent, nor write or read its memory, nor send it a notification); the other authenticates every
notification frame (keyed BLAKE2b, a MAC by design (RFC 7693), 16 bytes; a fraction of a
microsecond a frame, where HMAC-SHA256 took several) over the sender's agent (name and
generation), the receiver's agent, a sequence number and the frame, so a frame is acted on only
if a holder of the secret sent it to this very incarnation, and only once. Sequence numbers never
go back for a receiver: every sealer starts from this process's clock in nanoseconds (wall time at
import plus monotonic time since), so a reconnect to the same incarnation (a new sealer) continues
above every number the last one used, and so does a restarted sender whose agent name came back
(a store that lost its generation counters). A third key authenticates the store values that
decide where bytes land or who takes part (``security/signed.py``).

``cryptography`` is imported on the first secret only: a Transport without one never needs it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import os
import struct
import threading
import time
from collections import OrderedDict
from typing import Any

from transport.errors import SignatureError

_RECORD_AAD = b"transport/peer-record/v3\x00"
_FRAME_DOMAIN = b"transport/frame/v1\x00"
_VALUE_DOMAIN = b"transport/store-value/v1"
NONCE_BYTES = 12
MAC_BYTES = 16
SEQ_BYTES = 8
#: what sealing adds to a notification frame: the sequence number and the MAC
TRAILER_BYTES = SEQ_BYTES + MAC_BYTES
#: how far behind the newest sequence number a frame may arrive and still be accepted once
#: (frames of one connection can overtake each other on a multi-worker backend)
REPLAY_WINDOW = 4096
#: senders whose replay windows are remembered; the least recently heard is forgotten first
MAX_SENDERS = 1 << 14
_SEQ = struct.Struct(">Q")
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ImportError(
            "secret= needs the 'cryptography' package (a dependency of transport): "
            "pip install cryptography"
        ) from e
    return hashes, AESGCM, HKDF


class Keys:
    """The keys one namespace's secret gives (see the module docstring). Immutable; one per
    (secret, namespace), shared by every Transport of the process that uses them."""

    def __init__(self, secret: bytes, namespace: str) -> None:
        hashes, aesgcm, hkdf = _crypto()

        def derive(label: bytes) -> bytes:
            out: bytes = hkdf(
                algorithm=hashes.SHA256(),
                length=32,
                salt=b"transport/v1",
                info=label + b"\x00" + namespace.encode(),
            ).derive(secret)
            return out

        self.namespace = namespace
        self._aead = aesgcm(derive(b"peer-record"))
        self._mac_key = derive(b"frame-mac")
        self._value_key = derive(b"store-value")

    # -- peer records ------------------------------------------------------------------------

    def seal_record(self, body: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        out: bytes = nonce + self._aead.encrypt(nonce, body, self._aad())
        return out

    def open_record(self, sealed: bytes) -> bytes:
        """The record body; SignatureError if it was not sealed with this secret and namespace."""
        if len(sealed) < NONCE_BYTES + 16:
            raise SignatureError("peer record is sealed but too short to open")
        try:
            body: bytes = self._aead.decrypt(
                sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], self._aad()
            )
        except Exception:  # cryptography's InvalidTag: wrong key, or bytes changed on the way
            raise SignatureError(
                "peer record does not open with the shared secret (another secret, or altered "
                "in the store); every peer of the namespace must use the same secret="
            ) from None
        return body

    def _aad(self) -> bytes:
        return _RECORD_AAD + self.namespace.encode()

    # -- notification frames -----------------------------------------------------------------

    def frame_mac(self, sender: str, receiver: str) -> Any:
        """The keyed BLAKE2b state of frames from ``sender`` to ``receiver``: copy it, add the
        sequence number and the frame, and its digest is their MAC."""
        prefix = b"".join(
            (_FRAME_DOMAIN, _len16(sender), sender.encode(), _len16(receiver), receiver.encode())
        )
        return hashlib.blake2b(prefix, key=self._mac_key, digest_size=MAC_BYTES)

    def sealer(self, sender: str, receiver: str) -> FrameSealer:
        return FrameSealer(self, sender, receiver)

    # -- store values --------------------------------------------------------------------------

    def value_mac(self, key: str, writer: str, generation: int, body: bytes) -> bytes:
        """The MAC of a store value: over the namespace, the key it is stored under, its writer
        (name and generation) and its body, so it cannot be moved to another key, attributed
        to another peer or incarnation, or altered."""
        h = hashlib.blake2b(key=self._value_key, digest_size=MAC_BYTES)
        for part in (_VALUE_DOMAIN, self.namespace.encode(), key.encode(), writer.encode()):
            h.update(len(part).to_bytes(4, "big"))
            h.update(part)
        h.update(generation.to_bytes(8, "big", signed=False))
        h.update(body)
        return h.digest()


def _len16(s: str) -> bytes:
    return len(s.encode()).to_bytes(2, "big")


@functools.lru_cache(maxsize=64)
def keys_for(secret: bytes, namespace: str) -> Keys:
    """The keys of ``secret`` in ``namespace`` (derived once per process)."""
    return Keys(secret, namespace)


_WALL_AT_START = time.time_ns()
_MONO_AT_START = time.monotonic_ns()
_clock_lock = threading.Lock()
_clock_last = 0


def sequence_base() -> int:
    """Where a new sealer's sequence numbers start: this process's clock in nanoseconds (wall
    time at import plus the monotonic time since, so it never goes back within the process), and
    above every base handed out before in this process. A sealer would have to seal more than a
    frame a nanosecond for a later sealer's numbers to reach its own."""
    global _clock_last
    with _clock_lock:
        now = _WALL_AT_START + (time.monotonic_ns() - _MONO_AT_START)
        _clock_last = max(now, _clock_last + 1)
        return _clock_last


class FrameSealer:
    """Seals the frames one agent sends to one peer incarnation: each gets the next sequence
    number and a MAC. The numbers start at :func:`sequence_base`, so they never go back for the
    receiver, whose replay window outlives our connection (a reconnect makes a new sealer).
    Callers seal under the connection's lock, so frames leave in sequence order (the receiver
    tolerates reordering within its window anyway)."""

    def __init__(self, keys: Keys, sender: str, receiver: str) -> None:
        self._mac = keys.frame_mac(sender, receiver)
        self._seq = itertools.count(sequence_base())

    def seal(self, frame: bytes) -> bytes:
        seq = _SEQ.pack(next(self._seq))
        h = self._mac.copy()
        h.update(seq)
        h.update(frame)
        return frame + seq + h.digest()


class FrameOpener:
    """Checks the frames that reach one agent (``receiver``): the MAC over sender, receiver,
    sequence number and frame, then the sender's replay window (each sequence number once; one
    more than :data:`REPLAY_WINDOW` behind the newest is refused). It owns one window per sender
    agent, at most :data:`MAX_SENDERS` (the least recently heard is forgotten first). Called on
    the engine thread only."""

    def __init__(self, keys: Keys, receiver: str) -> None:
        self._keys = keys
        self._receiver = receiver
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def open(self, sender: str, sealed: bytes) -> bytes:
        """The frame without its trailer; SignatureError naming the rule it broke."""
        if len(sealed) < TRAILER_BYTES + 1:
            raise SignatureError(
                "notification carries no MAC, but this Transport requires the namespace's secret"
            )
        frame = sealed[:-TRAILER_BYTES]
        seq = sealed[-TRAILER_BYTES:-MAC_BYTES]
        window = self._windows.get(sender)
        if window is None:
            window = _Window(self._keys.frame_mac(sender, self._receiver))
        h = window.mac.copy()
        h.update(seq)
        h.update(frame)
        if not hmac.compare_digest(sealed[-MAC_BYTES:], h.digest()):
            raise SignatureError(
                "notification MAC does not match (its sender lacks the shared secret, or it "
                "was meant for another peer or incarnation)"
            )
        if sender not in self._windows:  # only a proven sender gets a window
            self._windows[sender] = window
            if len(self._windows) > MAX_SENDERS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(sender)
        window.accept(_SEQ.unpack(seq)[0])
        return frame


class _Window:
    """The sequence numbers seen from one sender: the newest, and which of the
    :data:`REPLAY_WINDOW` before it arrived."""

    __slots__ = ("mac", "newest", "seen")

    def __init__(self, mac: Any) -> None:
        self.mac = mac  # the sender's MAC state (Keys.frame_mac)
        self.newest = 0
        self.seen = 0  # bit i: newest - i arrived

    def accept(self, seq: int) -> None:
        if seq == 0:
            raise SignatureError("notification has sequence number 0, which no sender uses")
        if seq > self.newest:
            shift = seq - self.newest
            self.seen = 1 if shift >= REPLAY_WINDOW else ((self.seen << shift) | 1) & _WINDOW_MASK
            self.newest = seq
            return
        age = self.newest - seq
        if age >= REPLAY_WINDOW:
            raise SignatureError(
                f"notification is {age} frames older than its sender's newest; refused as a "
                "possible replay"
            )
        if self.seen >> age & 1:
            raise SignatureError("notification was already received once; refused as a replay")
        self.seen |= 1 << age
