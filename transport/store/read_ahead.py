"""Store reads made together ahead of the calls that need them: a caller that knows which keys
its next steps read (a publisher: its lease, the group's epoch, its members' heartbeats) reads
them in one multi-key read, on a pool thread while it does other work if it likes, and the
first read of each key on its thread takes the value from there (``Store.reading_ahead``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout

from transport.errors import ClosedError, StoreError, StoreTimeout

#: how long a read waits for a read ahead still under way: the store's own calls time out
#: sooner (connect 10 s, a call's answer within its client's timeout), so this only bounds a
#: pool that never ran the read
WAIT_S = 120.0


class ReadAhead:
    """One multi-key read and what of it this thread has not taken yet.

    It owns the keys not yet taken and the read's outcome: the values, or the StoreError (or
    ClosedError) it raised, which each of those keys' first reads raises in turn, as reading them
    one by one would have. Rules: each key is taken once (a later read goes to the store, so a
    caller that writes a key and reads it back sees its write); only the thread that opened it
    takes from it (other threads never see it); a read still under way is waited for at the
    first take, at most WAIT_S seconds (then StoreTimeout)."""

    def __init__(
        self,
        read: Callable[[list[str]], Mapping[str, bytes | None]],
        keys: Iterable[str],
        pool: Executor | None = None,
    ) -> None:
        wanted = list(dict.fromkeys(keys))
        self.left = set(wanted)
        self._values: Mapping[str, bytes | None] | None = None
        self._error: Exception | None = None
        self._future: Future[Mapping[str, bytes | None]] | None = None
        with contextlib.suppress(RuntimeError):  # a pool shut down (its owner closing): now
            self._future = None if pool is None else pool.submit(read, wanted)
        if self._future is None:
            self._settle(lambda: read(wanted))

    def _settle(self, read: Callable[[], Mapping[str, bytes | None]]) -> None:
        try:
            self._values = read()
        except (StoreError, ClosedError) as e:
            self._error = e

    def take(self, key: str) -> tuple[bool, bytes | None]:
        """(True, the value read) the first time ``key`` is asked for; (False, None) after that,
        and for a key not read ahead."""
        if key not in self.left:
            return False, None
        self.left.discard(key)
        if self._values is None and self._error is None and self._future is not None:
            future = self._future
            self._settle(lambda: _result(future))
        if self._error is not None:
            raise self._error.with_traceback(None)
        assert self._values is not None
        return True, self._values.get(key)


def _result(future: Future[Mapping[str, bytes | None]]) -> Mapping[str, bytes | None]:
    try:
        return future.result(timeout=WAIT_S)
    except FutureTimeout:
        raise StoreTimeout(f"a read of the store made ahead took over {WAIT_S:g} s") from None


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
