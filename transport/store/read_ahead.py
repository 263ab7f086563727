"""Store reads made together ahead of the calls that need them: a caller that knows which keys
its next steps read (a publisher: its lease, the group's epoch, its members' heartbeats) reads
them in one multi-key read, and the first read of each key on its thread takes the value from
there (``Store.reading_ahead``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

from transport.errors import ClosedError, StoreError


class ReadAhead:
    """One multi-key read and what of it this thread has not taken yet.

    It owns the keys not yet taken and the read's outcome: the values, or the StoreError (or
    ClosedError) it raised, which each of those keys' first reads raises in turn, as reading them
    one by one would have. Rules: each key is taken once (a later read goes to the store, so a
    caller that writes a key and reads it back sees its write); only the thread that opened it
    takes from it (other threads never see it)."""

    def __init__(
        self, read: Callable[[list[str]], Mapping[str, bytes | None]], keys: Iterable[str]
    ) -> None:
        wanted = list(dict.fromkeys(keys))
        self.left = set(wanted)
        self._values: Mapping[str, bytes | None] = {}
        self._error: Exception | None = None
        try:
            self._values = read(wanted)
        except (StoreError, ClosedError) as e:
            self._error = e

    def take(self, key: str) -> tuple[bool, bytes | None]:
        """(True, the value read) the first time ``key`` is asked for; (False, None) after that,
        and for a key not read ahead."""
        if key not in self.left:
            return False, None
        self.left.discard(key)
        if self._error is not None:
            raise self._error.with_traceback(None)
        return True, self._values.get(key)


# The reads ahead open on each thread: the store's id -> its read.
_OPEN = threading.local()


def opened() -> dict[int, ReadAhead]:
    """This thread's reads ahead, by the id of their store."""
    stores: dict[int, ReadAhead] | None = getattr(_OPEN, "stores", None)
    if stores is None:
        stores = _OPEN.stores = {}
    return stores


def take(store_id: int, key: str) -> tuple[bool, bytes | None]:
    """What :meth:`ReadAhead.take` gives for ``key`` from this thread's read of that store."""
    stores: dict[int, ReadAhead] | None = getattr(_OPEN, "stores", None)
    ahead = stores.get(store_id) if stores else None
    return (False, None) if ahead is None else ahead.take(key)
