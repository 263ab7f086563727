"""A store that passes every call to another: the base of the tests' stores that watch or
interleave calls (override the calls to watch, call ``super()`` for the rest)."""

from __future__ import annotations

from collections.abc import Iterable

from transport import Store


class ForwardingStore(Store):
    """``inner`` as it is; closing it leaves ``inner`` open (its owner closes it)."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url = inner, inner.url

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.inner.get(key, timeout)

    def try_get(self, key: str) -> bytes | None:
        return self.inner.try_get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def add(self, key: str, amount: int = 1) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        return self.inner.compare_set(key, expected, desired)

    def compare_delete(self, key: str, expected: bytes) -> bool:
        return self.inner.compare_delete(key, expected)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        self.inner.wait(keys, timeout)

    def close(self) -> None:
        pass
