"""An in-process store: a dict behind a condition variable.

``memory://NAME`` opens the process-wide store of that name, so several
objects in one process (two Transports in a test, say) share their keys;
``memory://`` opens a fresh private one. Nothing leaves the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from transport.errors import StoreError, StoreTimeout
from transport.store.base import (
    DEFAULT_TIMEOUT,
    Store,
    check_amount,
    check_key,
    check_value,
    deadline_after,
    parse_integer,
)


class _Data:
    """The keys of one memory store, shared by every MemoryStore opened on it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()


_named: dict[str, _Data] = {}
_named_lock = threading.Lock()


class MemoryStore(Store):
    """A store held in this process's memory.

    A named store lives as long as the process (a later ``MemoryStore("x")``
    sees what an earlier, even closed, one wrote); an unnamed one lives as long
    as this object. Closing an object wakes its waiting calls with
    :class:`~transport.errors.ClosedError` and leaves the data to the other
    objects on the same name.
    """

    def __init__(self, name: str | None = None) -> None:
        if name is None or name == "":
            self._data = _Data()
            self.url = "memory://"
        else:
            if not isinstance(name, str):
                raise TypeError(f"memory store name must be str, not {type(name).__name__}")
            with _named_lock:
                self._data = _named.setdefault(name, _Data())
            self.url = f"memory://{name}"
        self.name = name or None
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait on the condition (held by the caller) until ``ready()`` or the deadline."""
        cond = self._data.changed
        while not ready():
            self._check_open()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            cond.wait(left)
        self._check_open()
        return True

    def set(self, key: str, value: bytes) -> None:
        key, value = check_key(key), check_value(value)
        with self._data.changed:
            self._check_open()
            self._data.values[key] = value
            self._data.changed.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        key = check_key(key)
        deadline = deadline_after(timeout)
        values = self._data.values
        with self._data.changed:
            self._check_open()
            if not self._wait_until(lambda: key in values, deadline):
                raise StoreTimeout(
                    f"key {key!r} did not appear in store {self.url} within "
                    f"{DEFAULT_TIMEOUT if timeout is None else timeout:g} s"
                )
            return values[key]

    def try_get(self, key: str) -> bytes | None:
        key = check_key(key)
        with self._data.changed:
            self._check_open()
            return self._data.values.get(key)

    def add(self, key: str, amount: int = 1) -> int:
        key, amount = check_key(key), check_amount(amount)
        with self._data.changed:
            self._check_open()
            old = self._data.values.get(key, b"0")
            number = parse_integer(old)
            if number is None:
                raise StoreError(
                    f"add({key!r}) on store {self.url}: the value is not a decimal integer"
                )
            number += amount
            self._data.values[key] = str(number).encode()
            self._data.changed.notify_all()
            return number

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        key, desired = check_key(key), check_value(desired)
        if expected is not None:
            expected = check_value(expected)
        with self._data.changed:
            self._check_open()
            if self._data.values.get(key) != expected:
                return False
            self._data.values[key] = desired
            self._data.changed.notify_all()
            return True

    def compare_delete(self, key: str, expected: bytes) -> bool:
        key, expected = check_key(key), check_value(expected)
        with self._data.changed:
            self._check_open()
            if self._data.values.get(key) != expected:
                return False
            del self._data.values[key]
            return True

    def delete(self, key: str) -> bool:
        key = check_key(key)
        with self._data.changed:
            self._check_open()
            return self._data.values.pop(key, None) is not None

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        wanted = [check_key(k) for k in keys]
        deadline = deadline_after(timeout)
        values = self._data.values
        with self._data.changed:
            self._check_open()
            if not self._wait_until(lambda: all(k in values for k in wanted), deadline):
                missing = [k for k in wanted if k not in values]
                raise StoreTimeout(
                    f"keys {missing!r} did not appear in store {self.url} within "
                    f"{DEFAULT_TIMEOUT if timeout is None else timeout:g} s"
                )

    def close(self) -> None:
        with self._data.changed:
            self._closed = True
            self._data.changed.notify_all()
