"""A closing Transport against its own housekeeping, and a restoring one against a restart, on
every store.

``Transport.close`` leaves the namespace (its record and heartbeat go) while its housekeeping
threads may be in the middle of a round: a heartbeat or a restore of the record that lands after
the leave makes the closed peer look alive until its heartbeat ages out. ``Directory.restore``
reads the record, judges it lost or not ours, and writes ours: a newer incarnation of the name
that writes its record in between must keep it. Each write is put exactly where it races by a
store whose calls run hooks (installed on the store object, undone by ``monkeypatch``): a
housekeeping thread is held inside a store call until the close has left, a newer
incarnation starts right after a read. No timing involved."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest

import transport
from helpers.records import record
from transport import Store
from transport.peers.directory import Directory
from transport.wire import encode_peer_record

pytestmark = [pytest.mark.stores, pytest.mark.unit, pytest.mark.timeout(60)]

NS = "close-race"
NAME = "gen-0"
CLOSER = "test-closer"  # the thread that closes the Transport
#: loopback agents live in one table per process: each Transport of these tests its own name
_names = itertools.count()


class StoreCalls:
    """Hooks around the calls of ``store`` (installed on the object itself, undone by
    ``monkeypatch``, so every Transport and directory on ``store`` goes through them): each
    function in ``before`` runs as ``f(method, key)`` before a call, each in ``after`` as
    ``f(method, key, result)`` after it, in the calling thread."""

    METHODS = ("try_get", "exists", "set", "compare_set", "compare_delete")

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.before: list[Callable[[str, str], None]] = []
        self.after: list[Callable[[str, str, object], None]] = []
        for method in self.METHODS:
            monkeypatch.setattr(store, method, self._hooked(method, getattr(store, method)))

    def _hooked(self, method: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(key: str, *args: Any, **kwargs: Any) -> Any:
            for first in list(self.before):
                first(method, key)
            result = call(key, *args, **kwargs)
            for then in list(self.after):
                then(method, key, result)
            return result

        return hooked


def _thread() -> str:
    return threading.current_thread().name


class Race:
    """One housekeeping call held, and the close's leave watched: ``reached`` is set once the
    call is held, ``left`` once the closing thread deleted our heartbeat (the last thing
    ``leave`` does), and the held call goes on once ``release`` is set."""

    def __init__(self) -> None:
        self.reached, self.left, self.release = (threading.Event() for _ in range(3))

    def hold(self) -> None:
        self.reached.set()
        assert self.release.wait(30), "the held call was never released"

    def watch_leave(self, hb: str) -> Callable[[str, str, object], None]:
        def watch(method: str, key: str, result: object) -> None:
            if method == "compare_delete" and key == hb and result and _thread() == CLOSER:
                self.left.set()

        return watch

    def close_while_held(self, t: transport.Transport) -> None:
        """Close ``t`` in another thread while the call is held; release the call once the close
        has left the namespace, and wait for the close to return. (The calls held here come
        before the check of the retired name: a close that waited for them fails here.)"""
        assert self.reached.wait(30), "the housekeeping call was never made"
        closer = threading.Thread(target=t.close, name=CLOSER)
        closer.start()
        try:
            assert self.left.wait(30), "close did not remove the heartbeat"
        finally:
            self.release.set()
            closer.join(30)
        assert not closer.is_alive(), "close did not return"


def _transport(store: Store, secret: bytes | None) -> transport.Transport:
    return transport.Transport(
        f"close-race-{next(_names)}",
        store=store,
        namespace=NS,
        secret=secret,
        backend="loopback",
        timeout=10,
        heartbeat_interval=0.05,  # housekeeping rounds come at once
    )


@pytest.fixture(params=[None, b"the-namespace-secret"], ids=["open", "secret"])
def secret(request: pytest.FixtureRequest) -> bytes | None:
    return request.param


def test_a_heartbeat_in_flight_as_the_transport_closes_does_not_outlive_it(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat thread is held in a store call on its heartbeat (before the call runs)
    while close leaves; released once the leave removed the heartbeat, it must not write it
    again."""
    calls, race = StoreCalls(store, monkeypatch), Race()
    t = _transport(store, secret)
    directory = Directory(store, NS, secret)
    hb, rec = directory.key("hb", t.name), directory.key("peers", t.name)

    def hold(method: str, key: str) -> None:
        if (
            key == hb
            and method in ("set", "try_get")  # the first call of a beat
            and _thread().startswith("transport-heartbeat-")
            and not race.reached.is_set()
        ):
            race.hold()

    calls.before.append(hold)
    calls.after.append(race.watch_leave(hb))

    race.close_while_held(t)

    assert store.try_get(hb) is None, "the closed peer's heartbeat came back"
    assert store.try_get(rec) is None, "the closed peer's record came back"
    assert directory.left(t.name) == t.generation


def test_a_restore_in_flight_as_the_transport_closes_does_not_outlive_it(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record is garbage (a store writer's): the housekeeping round reads it, judges that
    its own must be put back, and is held right after that read while close leaves (which
    removes the garbage as ours, and the heartbeat). Released, it must not put the record back."""
    calls, race = StoreCalls(store, monkeypatch), Race()
    t = _transport(store, secret)
    directory = Directory(store, NS, secret)
    hb, rec = directory.key("hb", t.name), directory.key("peers", t.name)
    garbage = b"\xc1 not a peer record"

    def hold(method: str, key: str, result: object) -> None:
        if (
            key == rec
            and result == garbage
            and _thread().startswith("transport-control-")
            and not race.reached.is_set()
        ):
            race.hold()

    calls.after.append(hold)
    calls.after.append(race.watch_leave(hb))
    store.set(rec, garbage)

    race.close_while_held(t)

    assert store.try_get(rec) is None, "the closed peer's record came back"
    assert store.try_get(hb) is None, "the closed peer's heartbeat came back"


def test_nothing_of_a_retired_name_is_written(store: Store, secret: bytes | None) -> None:
    directory = Directory(store, NS, secret)
    gen = directory.join(NAME)
    assert directory.retire(NAME, 1.0)
    rec = record(name=NAME, namespace=NS, generation=gen, agent=f"{NAME}#{gen}")
    directory.publish(rec)
    assert not directory.restore(rec)
    assert not directory.heartbeat(NAME, gen)
    assert store.try_get(directory.key("peers", NAME)) is None
    assert store.try_get(directory.key("hb", NAME)) is None


# -- restore against a restart under the same name ----------------------------------------------


class ReadHooks:
    """Right after ``store.try_get`` reads a key given to :meth:`after_read`, the function given
    with it runs (once): what another process does between a read and the write the reader
    decides on."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self._hooks: dict[str, Callable[[], None]] = {}
        self.fired: list[str] = []
        StoreCalls(store, monkeypatch).after.append(self._after)

    def after_read(self, key: str, action: Callable[[], None]) -> None:
        self._hooks[key] = action

    def _after(self, method: str, key: str, result: object) -> None:
        action = self._hooks.pop(key, None) if method == "try_get" else None
        if action is not None:
            self.fired.append(key)
            action()


def _start(directory: Directory) -> tuple[int, bytes]:
    """What a Transport does as it starts under NAME: a generation, its record, a heartbeat;
    the generation and the record's stored bytes."""
    gen = directory.join(NAME)
    directory.publish(record(name=NAME, namespace=NS, generation=gen, agent=f"{NAME}#{gen}"))
    directory.heartbeat(NAME, gen)
    written = directory.written(NAME)
    assert written is not None
    return gen, written


@pytest.mark.parametrize("found", ["nothing", "garbage", "an older record"])
def test_a_newer_incarnation_that_writes_while_the_old_one_restores_keeps_its_record(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    """The old incarnation's housekeeping reads its record's key, finds ``found`` there and
    judges that its own must be put back; right after that read, the name restarts elsewhere
    and writes its record. The newer record must stay."""
    hooks = ReadHooks(store, monkeypatch)
    old, new = Directory(store, NS, secret), Directory(store, NS, secret)
    first, _ = _start(old)
    mine = record(name=NAME, namespace=NS, generation=first, agent=f"{NAME}#{first}")
    key = old.key("peers", NAME)
    if found == "nothing":
        store.delete(key)  # a store that lost it
    elif found == "garbage":
        store.set(key, b"\xc1 not a peer record")
    else:  # an older incarnation's, put back (a replay)
        store.set(key, _older(secret))
    second: list[tuple[int, bytes]] = []
    hooks.after_read(key, lambda: second.append(_start(new)))

    restored = old.restore(mine)

    assert hooks.fired == [key] and second and second[0][0] > first
    assert store.try_get(key) == second[0][1], "the newer incarnation's record was overwritten"
    assert not restored
    rec = new.fetch(NAME)
    assert rec is not None and rec.generation == second[0][0]
    assert not old.restore(mine), "a newer incarnation's record is never replaced"
    assert store.try_get(key) == second[0][1]


def _older(secret: bytes | None) -> bytes:
    """The stored bytes of a record of an incarnation older than any the store handed out."""
    return encode_peer_record(
        record(name=NAME, namespace=NS, generation=1, agent=f"{NAME}#1"), secret
    )


def test_restore_puts_back_a_lost_record_and_an_older_one(
    store: Store, secret: bytes | None
) -> None:
    directory = Directory(store, NS, secret)
    gen, _ = _start(directory)
    mine = record(name=NAME, namespace=NS, generation=gen, agent=f"{NAME}#{gen}")
    key = directory.key("peers", NAME)
    assert not directory.restore(mine)  # what it wrote: nothing to do
    store.delete(key)
    assert directory.restore(mine)
    assert store.try_get(key) == directory.written(NAME)
    store.set(key, _older(secret))
    assert directory.restore(mine)
    rec = directory.fetch(NAME)
    assert rec is not None and rec.generation == gen


def test_a_newer_incarnation_that_beats_while_the_old_one_beats_keeps_its_heartbeat(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old incarnation still running (frozen, then resumed) reads the heartbeat; right after,
    the newer one beats. The newer heartbeat stays, and the old one no longer beats over it."""
    hooks = ReadHooks(store, monkeypatch)
    old, new = Directory(store, NS, secret), Directory(store, NS, secret)
    first, _ = _start(old)
    second: list[tuple[int, bytes]] = []
    key = old.key("hb", NAME)
    hooks.after_read(key, lambda: second.append(_start(new)))

    beat_over = old.heartbeat(NAME, first)

    assert hooks.fired == [key] and second
    assert not beat_over
    beat = new.last_heartbeat(NAME)
    assert beat is not None and beat[0] == second[0][0]
    assert not old.heartbeat(NAME, first)
    beat = new.last_heartbeat(NAME)
    assert beat is not None and beat[0] == second[0][0]
