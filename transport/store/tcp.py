"""The embedded default store: ``torch.distributed.TCPStore``, no server to install.

URL: ``tcp://HOST:PORT[?timeout=SECONDS&host=auto|yes|no]``.

``host=auto`` (the default): when HOST is an address of this machine, the first
process to bind PORT serves the store and every later opener joins it as a
client; the bind decides, so simultaneous openers are safe. ``host=yes`` always
serves (and fails when the port is taken); ``host=no`` always joins. ``timeout``
bounds connecting (default 10 s): an unreachable store fails within it.

The keys live in the serving process: when it closes the store or exits, they are
gone, and every other process sees :class:`~transport.errors.StoreError` on its
next call (or at once, for a call waiting on a key). Reconnecting is attempted on
each later call, each attempt taking up to the connect timeout.

Measured behaviours of TCPStore (torch 2.13) this module works around:

* A client object serialises its calls: a ``get`` waiting for a key holds up every
  other thread using that object. Each thread that waits for keys (``get``, ``wait``)
  gets its own client; the calls that answer at once share one client per object.
* Each connection makes both ends look up the name of the peer's address (for torch's log
  lines, also where nothing is logged): two reverse DNS queries per connection, for an address
  that no hosts file lists (IPv4 mapped into IPv6). Where the resolver is slow or drops
  queries, a connection waits for it (glibc: 5 s before it asks again; ``RES_OPTIONS``, for
  example ``timeout:1``, shortens that). A process with a dozen Transports, each with a
  client per thread, connected dozens of times: hence the shared client.
* A wait with a zero (or very short) timeout can time out even when the key
  exists, before the server's answer arrives; ``check`` is used to look first.
* ``get`` is two round trips (a wait for the key, then its value) and holds a missing
  key until its timeout, so a read that must not wait took three (``check`` first).
  ``compare_set(key, P, P)`` with a value P that no key holds reads in one: the server
  answers the value, or P for a missing key, and changes nothing (``try_get``).
* ``compare_set(key, "", new)`` sets ``key`` when it is missing *or holds the
  empty value*, and the returned value alone cannot tell success from failure.
  Values that are empty or start with byte 0xFF or with the two bytes ``0`` 0xFF,
  and values written by ``compare_set``, are therefore stored with a 9-byte header
  (0xFF and a random nonce), which makes every compare-and-set exact. A successful
  ``compare_set`` writes the plain value back right away, so ``add`` works on it
  afterwards.
* There is no conditional delete (``delete_key`` is blind). ``compare_delete``
  compare-and-sets the value it expects to a *tombstone*: ``0`` 0xFF and a random
  nonce, a stored form no value takes (see above), unique so that the answer tells
  whether this call made the swap. Every method takes a tombstone for a missing key:
  ``get`` and ``wait`` poll it (1 ms to 50 ms) until a value replaces it, ``try_get``
  gives None, ``exists`` and ``delete`` give False (and leave it), ``compare_set(key,
  None, v)`` swaps it for ``v``, and ``add`` counts it as 0 by itself (the server
  reads the leading ``0``). A tombstone stays, a few bytes, until the key is written
  again: removing it with ``delete_key`` could remove a value set just before. Telling
  a tombstone from a value takes reading the value, so ``exists``, ``wait`` and
  ``delete`` read the value of a key that is there (``check`` alone cannot tell).
* ``add`` on a value that is not a decimal integer makes the server drop the
  connection; it is reported as :class:`~transport.errors.StoreError`. The server
  parses a leading integer (``add`` on ``b"12abc"`` gives 13) and wraps at 2**63.
* The server does not answer ``set``: a set sent to a frozen or dead host returns
  as if it worked. ``set`` here waits for the answer to a ``check`` sent after it.
* Keys containing NUL are cut at the NUL by the server; all stores refuse them.
* Every timed-out wait makes torch log two warnings to stderr (its C++ logger;
  ``TORCH_CPP_LOG_LEVEL=ERROR`` silences them).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch.distributed as dist

from transport.errors import StoreError, StoreTimeout
from transport.store.base import (
    DEFAULT_TIMEOUT,
    Store,
    check_amount,
    check_key,
    check_timeout,
    check_value,
    deadline_after,
)
from transport.store.tcp_url import HOSTING_MODES, is_local_address, parse_tcp_url

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 10.0
#: how long an opener that lost the race to host a store waits for the winner to listen
RACE_GRACE_S = 2.0

# Values go to TCPStore as bytes: its stubs say str, but the bindings take bytes too
# and keep every byte (hence the type: ignore[arg-type] comments below).
_MARK = b"\xff"
_HEADER_LEN = 9  # the mark and an 8-byte nonce
#: the largest value set() accepts: TCPStore's payload limit, less our header and the key
MAX_VALUE_BYTES = (8 << 20) - 4096
# How long a get waits for a key that check() has just seen before it checks again (the key may
# have been deleted in between, or the server may be slow to answer).
_GRACE = 1.0
# try_get_many reads more keys than this with a multi_get (three round trips for all of them)
_MANY = 3


# What compare_delete leaves: the tombstone's prefix and a nonce. The server's add reads the
# leading "0" of it, and values starting with it are stored with the header.
_TOMB = b"0\xff"
_TOMB_NONCE_LEN = 8
# What a read expects (and leaves): shorter than any tombstone, and no value is stored in a form
# that starts with the tombstone's prefix, so no key ever holds it.
_PROBE = _TOMB
# How a get or wait polls a key that holds a tombstone (TCPStore's wait sees the key as there).
_FIRST_POLL = 0.001
_MAX_POLL = 0.05


def _encode(value: bytes, *, unique: bool = False) -> bytes:
    if unique or not _plain(value):
        return _MARK + os.urandom(_HEADER_LEN - 1) + value
    return value


def _decode(raw: bytes) -> bytes:
    return raw[_HEADER_LEN:] if raw.startswith(_MARK) else raw


def _plain(value: bytes) -> bool:
    """Whether ``value`` is stored as it is (it looks neither like a header nor a tombstone)."""
    return bool(value) and not value.startswith(_MARK) and not value.startswith(_TOMB)


def _tombstone() -> bytes:
    return _TOMB + os.urandom(_TOMB_NONCE_LEN)


def _live(raw: bytes) -> bool:
    """Whether a stored ``raw`` value is a value, not a tombstone."""
    return not raw.startswith(_TOMB)


def _span(seconds: float) -> datetime.timedelta:
    """``seconds`` for TCPStore, rounded up to whole milliseconds: it counts in milliseconds, and
    a fraction cut off made its waits end up to a millisecond before our deadline."""
    return datetime.timedelta(milliseconds=math.ceil(max(seconds, 0.0) * 1000))


class TcpStore(Store):
    """A store served by ``torch.distributed.TCPStore``, hosted by one of its users.

    ``hosting`` is ``"auto"``, ``"yes"`` or ``"no"`` as the URL's ``host=`` option;
    ``timeout`` bounds connecting. ``port=0`` with hosting picks a free port
    (read it back from :attr:`port` or :attr:`url`). :attr:`url` is the URL a
    child process should open to join this store.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 29517,
        *,
        hosting: str = "auto",
        timeout: float | None = None,
    ) -> None:
        if hosting not in HOSTING_MODES:
            raise ValueError(f"hosting must be one of {', '.join(HOSTING_MODES)}, got {hosting!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int from 0 to 65535, got {port!r}")
        given_timeout = check_timeout(timeout)
        self._connect_timeout = DEFAULT_CONNECT_TIMEOUT if given_timeout is None else given_timeout
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._local = threading.local()
        #: the client of the calls that answer at once, and the lock that serialises them
        self._shared: dist.TCPStore | None = None
        self._shared_lock = threading.RLock()  # a call may make another (a retry, a probe)
        self._closed = False
        self._master: dist.TCPStore | None = None
        self.url = self._make_url(hosting, given_timeout)

        serve = hosting == "yes" or (hosting == "auto" and is_local_address(host))
        if port == 0 and not serve:
            raise ValueError(
                f"store {self.url}: port 0 (any free port) only works for the process that "
                "hosts the store; name the port to join a store"
            )
        if serve:
            self._master = self._try_to_host(required=hosting == "yes")
        if self._master is not None:
            self._port = self._master.port
            self.url = self._make_url(hosting, given_timeout)
            logger.info("hosting store %s", self.url)
        else:
            # connect now: an unreachable store fails here, within the timeout; one that lost
            # the race to host gives the winner a moment to listen on the port it bound
            with self._shared_lock:
                self._shared = self._connect(self._connect_timeout, race=serve)
            logger.debug("joined store %s as a client", self.url)

    @classmethod
    def from_url(cls, url: str, *, timeout: float | None = None) -> TcpStore:
        host, port, hosting, url_timeout = parse_tcp_url(url)
        return cls(host, port, hosting=hosting, timeout=url_timeout if timeout is None else timeout)

    @property
    def is_host(self) -> bool:
        """Whether this object serves the store (its keys go when it closes)."""
        return self._master is not None

    @property
    def port(self) -> int:
        return self._port

    def _make_url(self, hosting: str, timeout: float | None) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        options = [f"timeout={timeout:g}"] if timeout is not None else []
        if hosting == "no":
            options.append("host=no")
        return f"tcp://{host}:{self._port}" + ("?" + "&".join(options) if options else "")

    # -- torch objects and their errors -----------------------------------------------

    @contextmanager
    def _torch_errors(self, op: str, timed_out: Callable[[], str] | None = None) -> Iterator[None]:
        """Map torch's store errors into StoreError / StoreTimeout: the one place that does.

        ``timed_out`` gives the message of a wait that ran out (the client stays usable).
        """
        try:
            yield
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower() and timed_out is not None:
                raise StoreTimeout(f"{timed_out()} in store {self.url}") from exc
            raise StoreError(f"{op} on store {self.url} failed: {_first_line(exc)}") from exc
        except dist.DistNetworkError as exc:
            self._local.client = None
            if op == "connect":
                raise StoreError(
                    f"cannot reach store {self.url} within {self._connect_timeout:g} s "
                    f"({_first_line(exc)}); start the process that hosts it first, "
                    "or pass store=redis://HOST:PORT to use a Redis server"
                ) from exc
            raise StoreError(
                f"{op} on store {self.url} lost the connection (the process hosting the store "
                f"may have exited): {_first_line(exc)}"
            ) from exc
        except RuntimeError as exc:  # torch.distributed.DistError and plain c10::Error
            raise StoreError(f"{op} on store {self.url} failed: {_first_line(exc)}") from exc

    def _try_to_host(self, *, required: bool) -> dist.TCPStore | None:
        try:
            with self._torch_errors("host"):
                return dist.TCPStore(
                    self._host,
                    self._port,
                    None,
                    True,
                    _span(self._connect_timeout),
                    wait_for_workers=False,
                )
        except StoreError as exc:
            if required:
                raise StoreError(
                    f"cannot host store {self.url}: {_first_line(exc.__cause__ or exc)}; "
                    "use host=auto to join a store already there, or choose another port"
                ) from exc.__cause__
            logger.debug("did not host %s (%s); joining it", self.url, exc)
            return None

    def _client(self, connect_timeout: float | None = None) -> dist.TCPStore:
        """This thread's client, connected on first use: for the calls that wait for keys (a
        client serialises its calls)."""
        if self._closed:
            raise self._closed_error()
        local = self._local
        client: dist.TCPStore | None = getattr(local, "client", None)
        if client is None:
            seconds = self._connect_timeout if connect_timeout is None else connect_timeout
            client = local.client = self._connect(seconds)
        return client

    @contextmanager
    def _quick(self) -> Iterator[dist.TCPStore]:
        """The client every thread shares for the calls that answer at once, held while the
        block runs (connected on first use; dropped when its connection fails)."""
        with self._shared_lock:
            if self._closed:
                raise self._closed_error()
            client = self._shared
            if client is None:
                client = self._shared = self._connect(self._connect_timeout)
            try:
                yield client
            except dist.DistNetworkError:
                self._shared = None
                raise

    def _connect(self, seconds: float, race: bool = False) -> dist.TCPStore:
        """A new client; ``race``: this object just failed to host the store because another
        opener bound the port first."""
        self._probe(seconds, min(seconds, RACE_GRACE_S) if race else 0.0)
        with self._torch_errors("connect"):
            return dist.TCPStore(self._host, self._port, None, False, _span(seconds))

    def _probe(self, seconds: float, grace: float = 0.0) -> None:
        """Fail at once when nothing listens on the port (after ``grace`` seconds of trying:
        a host that won the race to bind it may not listen yet): torch's client would retry
        (and log a stack trace per try) until its timeout instead."""
        end = time.monotonic() + grace
        while True:
            try:
                with socket.create_connection((self._host, self._port), timeout=min(seconds, 5.0)):
                    return
            except ConnectionRefusedError as exc:
                if time.monotonic() < end:
                    time.sleep(0.01)
                    continue
                raise StoreError(
                    f"cannot reach store {self.url}: nothing listens on {self._host}:{self._port}; "
                    "start the process that hosts it first, or pass store=redis://HOST:PORT to use "
                    "a Redis server"
                ) from exc
            except OSError:  # a timeout or an unreachable network: let torch's client report it
                return

    def _raw_try_get(self, client: dist.TCPStore, key: str) -> bytes | None:
        """The stored form of ``key``'s value, or None when it is missing: one round trip. A
        ``compare_set`` to the value it expects is a read: the server answers the value it
        holds, or, for a missing key, the expected value itself (:data:`_PROBE`, a form no
        stored value takes), and it changes nothing (a ``check`` and a ``get`` took three
        round trips: a get waits for its key first)."""
        raw = bytes(client.compare_set(key, _PROBE, _PROBE))  # type: ignore[arg-type]
        return None if raw == _PROBE else raw

    # -- the Store contract -----------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        key, value = check_key(key), check_value(value)
        if len(value) > MAX_VALUE_BYTES:
            # the server would drop the connection on it (libuv backend: 8 MiB payloads at most)
            raise ValueError(
                f"a value of {len(value)} bytes is over the embedded store's limit of {MAX_VALUE_BYTES}; "
                "store less, or use a redis:// store"
            )
        with self._torch_errors("set"), self._quick() as client:
            client.set(key, _encode(value))  # type: ignore[arg-type]
            client.check([key])  # TCPStore does not answer a set: this answer confirms it

    def get(self, key: str, timeout: float | None = None) -> bytes:
        key = check_key(key)
        deadline = deadline_after(timeout)
        seconds = DEFAULT_TIMEOUT if timeout is None else timeout

        def missing() -> str:
            return f"key {key!r} did not appear within {seconds:g} s"

        with self._torch_errors("get"):
            client = self._client()
        pause = _FIRST_POLL
        while True:
            with self._torch_errors("get"):
                raw = self._raw_try_get(client, key)
            if raw is None:
                self._wait_until(client, [key], deadline, "get", missing)
            elif _live(raw):
                return _decode(raw)
            else:  # a tombstone: TCPStore's wait sees a key there
                pause = self._pause(pause, deadline, missing)

    batched_reads = True

    def try_get(self, key: str) -> bytes | None:
        key = check_key(key)
        found, value = self._read_ahead(key)
        if found:
            return value
        with self._torch_errors("try_get"), self._quick() as client:
            raw = self._raw_try_get(client, key)
        return _decode(raw) if raw is not None and _live(raw) else None

    def try_get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Three round trips when every key is there (a ``check`` of all, then a ``multi_get``,
        which waits for them first), else one a key; a few keys are read one by one."""
        wanted = list(dict.fromkeys(check_key(k) for k in keys))
        if not wanted:
            return {}
        with self._torch_errors("try_get"), self._quick() as client:
            raws: list[bytes | None] | None = None
            if len(wanted) > _MANY and client.check(wanted):
                client.set_timeout(_span(_GRACE))
                try:
                    raws = list(client.multi_get(wanted))
                except dist.DistStoreError:
                    pass  # one was deleted after the check (multi_get waited for it)
                finally:
                    client.set_timeout(_span(self._connect_timeout))
            if raws is None:
                raws = [self._raw_try_get(client, k) for k in wanted]
        return {
            k: _decode(raw) if raw is not None and _live(raw) else None
            for k, raw in zip(wanted, raws, strict=True)
        }

    def exists(self, key: str) -> bool:
        key = check_key(key)
        with self._torch_errors("exists"), self._quick() as client:
            return not self._absent(client, key)

    def _absent(self, client: dist.TCPStore, key: str) -> bool:
        """Whether ``key`` is missing or holds a tombstone (``check`` first: a missing key is not
        read)."""
        raw = self._raw_try_get(client, key)
        return raw is None or not _live(raw)

    def _pause(self, pause: float, deadline: float, missing: Callable[[], str]) -> float:
        """Sleep ``pause`` (less when the deadline comes first) before a key holding a tombstone
        is looked at again; StoreTimeout at the deadline. Returns the next pause."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreTimeout(f"{missing()} in store {self.url}")
        time.sleep(min(pause, left))
        if self._closed:
            raise self._closed_error()
        return min(pause * 2, _MAX_POLL)

    def add(self, key: str, amount: int = 1) -> int:
        key, amount = check_key(key), check_amount(amount)
        try:
            with self._torch_errors("add"), self._quick() as client:
                return int(client.add(key, amount))
        except StoreError as exc:
            if not isinstance(exc.__cause__, dist.DistNetworkError) or not self._reachable():
                raise
            self._not_an_integer(key, exc)

    def _reachable(self) -> bool:
        try:
            with self._torch_errors("connect"):
                self._client(connect_timeout=min(self._connect_timeout, 1.0)).check(["-"])
            return True
        except StoreError:
            return False

    def _not_an_integer(self, key: str, exc: StoreError) -> NoReturn:
        raise StoreError(
            f"add({key!r}) on store {self.url}: the value is not a decimal integer"
        ) from exc.__cause__

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        key, desired = check_key(key), check_value(desired)
        if expected is not None:
            expected = check_value(expected)
        new = _encode(desired, unique=True)  # unique: the answer equals it only if we set it
        with self._torch_errors("compare_set"), self._quick() as client:
            if expected is None:
                swapped = self._create(client, key, new)
            else:
                swapped = self._swap(client, key, expected, new)
            if swapped and _plain(desired):
                # Plain again, unless changed since.
                client.compare_set(key, new, desired)  # type: ignore[arg-type]
        return swapped

    def compare_delete(self, key: str, expected: bytes) -> bool:
        key, expected = check_key(key), check_value(expected)
        with self._torch_errors("compare_delete"), self._quick() as client:
            return self._swap(client, key, expected, _tombstone())

    @staticmethod
    def _create(client: dist.TCPStore, key: str, new: bytes) -> bool:
        """Set ``key`` to ``new`` (unique) if it is missing or holds a tombstone."""
        # Stored values are never empty, so "" matches a missing key only.
        held = b""
        while True:
            current = client.compare_set(key, held, new)  # type: ignore[arg-type]
            if current == new:
                return True
            if held and current == held:
                held = b""  # TCPStore answers the expected value itself: the tombstone went
            elif _live(current):
                return False
            else:
                held = current  # a tombstone: swap that

    def _swap(self, client: dist.TCPStore, key: str, expected: bytes, new: bytes) -> bool:
        """Set ``key`` to ``new`` (unique) if its value is ``expected``, whatever header the
        stored form of ``expected`` carries."""
        raw = self._raw_try_get(client, key)
        while raw is not None and _live(raw) and _decode(raw) == expected:
            current = client.compare_set(key, raw, new)  # type: ignore[arg-type]
            if current == new:
                return True
            # TCPStore answers the expected value itself when the key is missing.
            raw = None if current == raw else current
        return False

    def delete(self, key: str) -> bool:
        key = check_key(key)
        with self._torch_errors("delete"), self._quick() as client:
            if self._absent(client, key):
                return False  # a tombstone stays: deleting it could delete a value set since
            return bool(client.delete_key(key))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        wanted = list(dict.fromkeys(check_key(k) for k in keys))
        deadline = deadline_after(timeout)
        seconds = DEFAULT_TIMEOUT if timeout is None else timeout

        def missing() -> str:
            try:
                absent = [k for k in wanted if self._absent(client, k)]
            except RuntimeError:
                absent = wanted
            return f"keys {absent!r} did not appear within {seconds:g} s"

        with self._torch_errors("wait"):
            client = self._client()
            if not wanted:
                return
        pause = _FIRST_POLL
        while True:
            with self._torch_errors("wait"):
                there = bool(client.check(wanted))
            if not there:
                self._wait_until(client, wanted, deadline, "wait", missing)
            with self._torch_errors("wait"):
                if not any(self._absent(client, k) for k in wanted):
                    return
            pause = self._pause(pause, deadline, missing)  # a tombstone, or a key deleted since

    def _wait_until(
        self,
        client: dist.TCPStore,
        keys: list[str],
        deadline: float,
        op: str,
        missing: Callable[[], str],
    ) -> None:
        """TCPStore's wait for ``keys``, to our ``deadline`` (StoreTimeout then): the deadline is
        ours, so a wait that TCPStore's own clock ends early goes on."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"{missing()} in store {self.url}")
            try:
                with self._torch_errors(op, missing):
                    client.wait(keys, _span(left))
                return
            except StoreTimeout:
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        """Drop every thread's client and, when this object hosts the store, stop serving.

        A call blocked in another thread is not interrupted by a client-side close; it
        ends at its own deadline (or at once, when this object was the host).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._local = threading.local()
            self._shared = None
            master, self._master = self._master, None
        if master is not None:
            logger.info("no longer hosting store %s", self.url)
            del master  # the last reference: the server stops


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
