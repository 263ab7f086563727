"""A store on a Redis server (redis-py).

URL: ``redis://[USER:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS&...]``, or
``rediss://`` for TLS. ``timeout`` (default 10 s) bounds connecting and each
command; other query options go to ``redis.Redis.from_url`` unchanged. Passwords
never appear in messages or in ``repr``; :attr:`url` keeps the full URL so that a
child process can open the same store.

Each command is sent once: redis-py's retries are off, so a connection lost
during ``add`` or ``compare_set`` is an error rather than a possible double
apply. Waiting for a key polls with a backoff from 1 ms to 50 ms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from transport.errors import StoreError, StoreTimeout
from transport.store.base import (
    DEFAULT_TIMEOUT,
    Store,
    check_amount,
    check_key,
    check_timeout,
    check_value,
    deadline_after,
    redact_url,
)

DEFAULT_CONNECT_TIMEOUT = 10.0
_FIRST_POLL = 0.001
_MAX_POLL = 0.05

# KEYS[1]; ARGV[1] = "1" when a value is expected (ARGV[2]) or "0" when the key must be missing.
_COMPARE_SET = """
local current = redis.call('GET', KEYS[1])
if ARGV[1] == '0' then
  if current then return 0 end
elseif current ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1]; ARGV[1] the value the key must hold to be deleted (GET answers false when it is missing).
_COMPARE_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def parse_redis_url(url: str) -> tuple[str, float | None]:
    """Check a redis URL; return it without our own options, and its ``timeout``."""
    rule = "a redis store URL is redis://[USER:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS]"
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"{rule} (rediss:// for TLS); got {shown!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"{rule}; the port of {shown!r} is not a number") from None
    if not parts.hostname:
        raise ValueError(f"{rule}; {shown!r} lacks the host")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{rule}; the database of {shown!r} must be a number, not {db!r}")
    timeout = None
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name != "timeout":
            query.append((name, value))
            continue
        try:
            timeout = check_timeout(float(value))
        except ValueError:
            raise ValueError(f"{rule}; timeout={value!r} is not a number of seconds >= 0") from None
    return parts._replace(query=urlencode(query)).geturl(), timeout


class RedisStore(Store):
    """A store on a Redis server; see the module docstring for the URL."""

    def __init__(self, url: str, *, timeout: float | None = None) -> None:
        redis_url, url_timeout = parse_redis_url(url)
        given = check_timeout(timeout)
        seconds = given if given is not None else url_timeout
        self._timeout = DEFAULT_CONNECT_TIMEOUT if seconds is None else seconds
        self.url = url
        self._closed = False
        try:
            self._redis = redis.Redis.from_url(
                redis_url,
                socket_connect_timeout=self._timeout,
                socket_timeout=self._timeout,
                retry=Retry(NoBackoff(), 0),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"redis store URL {redact_url(url)!r}: {exc}") from None
        self._compare_set = self._redis.register_script(_COMPARE_SET)
        self._compare_delete = self._redis.register_script(_COMPARE_DELETE)
        try:
            with self._redis_errors("connect"):
                self._redis.ping()
        except TypeError as exc:  # an option redis-py does not know, found at first connect
            self._redis.close()
            raise ValueError(f"redis store URL {redact_url(url)!r}: {exc}") from None
        except StoreError:
            self._redis.close()
            raise

    @contextmanager
    def _redis_errors(self, op: str) -> Iterator[None]:
        """Map redis-py's errors into StoreError: the one place that does."""
        if self._closed:
            raise self._closed_error()
        shown = redact_url(self.url)
        try:
            yield
        except redis.exceptions.AuthenticationError as exc:
            raise StoreError(
                f"{op} on store {shown}: authentication failed ({exc}); check the user and "
                "password in the URL"
            ) from exc
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreError(
                f"cannot reach store {shown} ({op}, timeout {self._timeout:g} s): {exc}; "
                "start the Redis server or fix the URL"
            ) from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(f"{op} on store {shown} failed: {exc}") from exc

    def _timed_out(self, what: str, timeout: float | None) -> StoreTimeout:
        seconds = DEFAULT_TIMEOUT if timeout is None else timeout
        return StoreTimeout(f"{what} within {seconds:g} s in store {redact_url(self.url)}")

    def _poll(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Call ``ready()`` with a growing pause until it is true or the deadline passes."""
        pause = _FIRST_POLL
        while True:
            if ready():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_POLL)
            if self._closed:
                raise self._closed_error()

    def set(self, key: str, value: bytes) -> None:
        key, value = check_key(key), check_value(value)
        with self._redis_errors("set"):
            self._redis.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        key = check_key(key)
        deadline = deadline_after(timeout)
        found: list[bytes] = []

        def ready() -> bool:
            value = self.try_get(key)
            if value is not None:
                found.append(value)
            return value is not None

        if not self._poll(ready, deadline):
            raise self._timed_out(f"key {key!r} did not appear", timeout)
        return found[0]

    batched_reads = True

    def try_get(self, key: str) -> bytes | None:
        key = check_key(key)
        found, ahead = self._read_ahead(key)
        if found:
            return ahead
        with self._redis_errors("get"):
            value = self._redis.get(key)
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def try_get_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """One round trip (MGET)."""
        wanted = list(dict.fromkeys(check_key(k) for k in keys))
        if not wanted:
            return {}
        with self._redis_errors("get"):
            values = self._redis.mget(wanted)
        return {
            k: None if v is None else bytes(v)  # type: ignore[arg-type]
            for k, v in zip(wanted, values, strict=True)  # type: ignore[arg-type]
        }

    def exists(self, key: str) -> bool:
        key = check_key(key)
        with self._redis_errors("exists"):
            return bool(self._redis.exists(key))

    def add(self, key: str, amount: int = 1) -> int:
        key, amount = check_key(key), check_amount(amount)
        with self._redis_errors(f"add({key!r})"):
            return int(self._redis.incrby(key, amount))  # type: ignore[arg-type]

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        key, desired = check_key(key), check_value(desired)
        flag = b"0" if expected is None else b"1"
        match = b"" if expected is None else check_value(expected)
        with self._redis_errors("compare_set"):
            return bool(self._compare_set(keys=[key], args=[flag, match, desired]))

    def compare_delete(self, key: str, expected: bytes) -> bool:
        key, expected = check_key(key), check_value(expected)
        with self._redis_errors("compare_delete"):
            return bool(self._compare_delete(keys=[key], args=[expected]))

    def delete(self, key: str) -> bool:
        key = check_key(key)
        with self._redis_errors("delete"):
            return bool(self._redis.delete(key))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        wanted = list(dict.fromkeys(check_key(k) for k in keys))
        deadline = deadline_after(timeout)
        if not wanted:
            with self._redis_errors("wait"):
                return

        def ready() -> bool:
            with self._redis_errors("wait"):
                return int(self._redis.exists(*wanted)) == len(wanted)  # type: ignore[arg-type]

        if not self._poll(ready, deadline):
            with self._redis_errors("wait"):
                missing = [k for k in wanted if not self._redis.exists(k)]
            raise self._timed_out(f"keys {missing!r} did not appear", timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._redis.close()
