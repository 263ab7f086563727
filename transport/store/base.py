"""The key-value store contract.

A store holds small byte values under string keys. It is how peers find each
other: never on the hot path of a transfer. Every blocking method takes a
``timeout`` (seconds, ``None`` for the store's default) that becomes one
deadline; on expiry it raises :class:`~transport.errors.StoreTimeout`. Any
other failure of the server or the connection raises
:class:`~transport.errors.StoreError`, chained to the client library's error.

Stores are safe to use from several threads at once.
"""

from __future__ import annotations

import abc
import math
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

from transport._closing import Closing
from transport.errors import ClosedError
from transport.store import read_ahead

DEFAULT_TIMEOUT = 30.0


class Store(Closing, abc.ABC):
    """Abstract key-value store. Implementations: memory, tcp (torch TCPStore), redis.

    Two conditional writes make read-decide-write sequences safe between processes:

    * :meth:`compare_set` replaces a value only if it is still the one the caller read (or
      creates the key only if it is still missing);
    * :meth:`compare_delete` deletes a value only if it is still the one the caller read, so a
      value that someone wrote after the read (a restarted peer's record, say) survives.

    Each is atomic against every other call on the store, from any thread or process, and
    answers exactly: ``True`` only for the call that made the change, so among callers racing
    on one value at most one wins. A plain :meth:`delete` is blind: it removes whatever the key
    holds by then. A deleted key, however it was deleted, is missing to every method: ``get``
    and ``wait`` wait for it, ``try_get`` gives ``None``, ``exists`` and ``delete`` give
    ``False``, ``compare_set(key, None, ...)`` creates it and ``add`` starts from 0.
    """

    #: the URL this store was opened from (for messages and for child processes)
    url: str = ""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it to appear.

        ``timeout=0`` does not wait. Raises StoreTimeout when the key is still
        missing at the deadline.
        """

    @abc.abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """Return the value of ``key`` or ``None`` when it is missing; never waits for the key."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` has a value, without reading it (a record may be megabytes)."""
        return self.try_get(key) is not None

    def try_get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """The value of each of ``keys`` as :meth:`try_get` gives it (None: missing). The
        values are read one by one here; a store with a multi-key read (``batched_reads``)
        answers in one or two round trips, which need not see all of them at one instant."""
        return {k: self.try_get(k) for k in dict.fromkeys(keys)}

    #: whether :meth:`try_get_many` reads its keys together (and :meth:`try_get` answers from
    #: :meth:`reading_ahead`); a store that answers in process has nothing to gain
    batched_reads = False

    @contextmanager
    def reading_ahead(self, keys: Iterable[str]) -> Iterator[None]:
        """Read ``keys`` now, together (:meth:`try_get_many`). While the block runs, the first
        :meth:`try_get` of each key on this thread answers from that read instead of the store;
        a later one reads the store again, so a caller that writes a key and reads it back sees
        its write. A read that failed fails each of those first reads with its error, as they
        would have failed one by one (transport/store/read_ahead.py). For a caller whose reads
        are known in advance (a publisher's lease, group epoch and heartbeats): one round trip
        instead of one each. A store without ``batched_reads``, and a block inside another of
        the same store on the same thread, read as before."""
        mine = read_ahead.opened()
        if not self.batched_reads or id(self) in mine:
            yield
            return
        mine[id(self)] = read_ahead.ReadAhead(self.try_get_many, keys)
        try:
            yield
        finally:
            del mine[id(self)]

    def _read_ahead(self, key: str) -> tuple[bool, bytes | None]:
        """For :meth:`try_get`: (True, the value) if this thread read ``key`` ahead and has
        not taken it yet (taken now); (False, None) otherwise."""
        return read_ahead.take(id(self), key)

    @abc.abstractmethod
    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing counts as 0); return the new value.

        What a value that is not a decimal integer does differs from store to store (StoreError,
        or a leading number taken): counters that others can write go through
        :class:`transport.store.counters.Counter`, which reads them strictly and repairs them.
        """

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Atomically set ``key`` to ``desired`` if its value is ``expected``.

        ``expected=None`` means "the key must be missing". Returns whether the
        value was set.
        """

    @abc.abstractmethod
    def compare_delete(self, key: str, expected: bytes) -> bool:
        """Atomically delete ``key`` if its value is exactly ``expected``; return whether it did.

        A missing key or any other value (one written since the caller read ``expected``)
        is left as it is and answers ``False``. Use it instead of reading then deleting.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``, whatever it holds; return whether it existed."""

    @abc.abstractmethod
    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` exists; StoreTimeout at the deadline."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections (and, for a store this process hosts, stop serving). Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r})"

    def _closed_error(self) -> ClosedError:
        return ClosedError(f"store {redact_url(self.url)} is closed; open a new one")


# Helpers shared by the implementations: argument checks, deadlines, messages.

_INTEGER = re.compile(rb"-?[0-9]+")


def check_key(key: object) -> str:
    """Return ``key`` if it is a usable key: a non-empty ``str`` without NUL characters."""
    if not isinstance(key, str):
        raise TypeError(f"store key must be str, not {type(key).__name__}")
    if not key or "\x00" in key:
        raise ValueError(f"store key must be a non-empty str without NUL characters, got {key!r}")
    return key


def check_value(value: object) -> bytes:
    """Return ``value`` as ``bytes``; accepts bytes, bytearray and memoryview."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        raise TypeError("store value must be bytes, not str; encode it first, e.g. value.encode()")
    raise TypeError(f"store value must be bytes, not {type(value).__name__}")


def check_amount(amount: object) -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"amount must be an int, not {type(amount).__name__}")
    return amount


def parse_integer(value: bytes) -> int | None:
    """The integer a counter value holds (decimal ASCII, as ``add`` writes it), or None."""
    if not _INTEGER.fullmatch(value) or len(value) > 64:  # int() refuses over 4,300 digits
        return None
    return int(value)


def check_timeout(timeout: object) -> float | None:
    """Return ``timeout`` as seconds (or None); rejects negative, infinite and non-numbers."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"timeout must be a number of seconds or None, not {type(timeout).__name__}"
        )
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(
            f"timeout must be a finite number of seconds >= 0 or None, got {timeout!r}"
        )
    return float(timeout)


def deadline_after(timeout: object, default: float = DEFAULT_TIMEOUT) -> float:
    """The ``time.monotonic()`` deadline of a call given ``timeout`` (None: ``default``)."""
    seconds = check_timeout(timeout)
    return time.monotonic() + (default if seconds is None else seconds)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
