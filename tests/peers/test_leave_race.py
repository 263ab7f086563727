"""``Directory.leave`` against a restart under the same name, on every store: a leaving
incarnation reads its record (or heartbeat), decides it is its own, and deletes it; a new
incarnation that writes its own between that read and that delete must keep it, or it vanishes
from the namespace while alive. The new incarnation's write is put exactly there by a store
whose ``try_get`` runs it right after reading the key (no timing involved)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from helpers.records import record
from helpers.stores import ForwardingStore
from transport import Store
from transport.peers import directory as peers
from transport.peers.directory import Directory

pytestmark = [pytest.mark.stores, pytest.mark.timeout(60)]

NS = "leave-race"
NAME = "gen-0"


class Interleaving(ForwardingStore):
    """``inner`` as it is, except that right after ``try_get`` reads a key given to
    :meth:`after_read`, the function given with it runs: what another process does between a
    read and the write the reader decides on. The owner closes ``inner``."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self._hooks: dict[str, Callable[[], None]] = {}
        self.fired: list[str] = []

    def after_read(self, key: str, action: Callable[[], None]) -> None:
        """Run ``action`` once, after the next read of ``key``."""
        self._hooks[key] = action

    def try_get(self, key: str) -> bytes | None:
        raw = self.inner.try_get(key)
        action = self._hooks.pop(key, None)
        if action is not None:
            self.fired.append(key)
            action()
        return raw


def _start(directory: Directory) -> int:
    """What a Transport does as it starts under NAME: a generation, its record, a heartbeat."""
    gen = directory.join(NAME)
    directory.publish(record(name=NAME, namespace=NS, generation=gen, agent=f"{NAME}#{gen}"))
    directory.heartbeat(NAME, gen)
    return gen


@pytest.fixture(params=[None, b"the-namespace-secret"], ids=["open", "secret"])
def secret(request: pytest.FixtureRequest) -> bytes | None:
    return request.param


@pytest.mark.parametrize("between", ["record", "heartbeat"])
def test_a_new_incarnation_that_writes_while_the_old_one_leaves_stays(
    store: Store, secret: bytes | None, between: str
) -> None:
    """``between``: the read of the leaving incarnation that the new one's writes follow."""
    racing = Interleaving(store)
    old = Directory(racing, NS, secret)
    new = Directory(store, NS, secret)  # the restarted process, with its own view of the store
    first = _start(old)
    second: list[int] = []
    racing.after_read(
        old.key("peers" if between == "record" else "hb", NAME), lambda: second.append(_start(new))
    )

    old.leave(NAME, first)

    assert racing.fired and second and second[0] > first
    rec = new.fetch(NAME)
    assert rec is not None and rec.generation == second[0], "the new incarnation's record went"
    assert store.try_get(new.key("peers", NAME)) == new.written(NAME)
    beat = new.last_heartbeat(NAME)
    assert beat is not None and beat[0] == second[0], "the new incarnation's heartbeat went"
    assert new.left(NAME) == first  # the old one did leave


def test_leave_removes_the_record_and_heartbeat_nobody_replaced(
    store: Store, secret: bytes | None
) -> None:
    directory = Directory(store, NS, secret)
    gen = _start(directory)
    assert directory.fetch(NAME) is not None and directory.last_heartbeat(NAME) is not None

    directory.leave(NAME, gen)

    assert directory.fetch(NAME) is None
    assert not store.exists(directory.key("peers", NAME))
    assert directory.last_heartbeat(NAME) is None
    assert not store.exists(directory.key("hb", NAME))
    assert directory.left(NAME) == gen
    # the name can start again after it
    again = _start(Directory(store, NS, secret))
    rec = directory.fetch(NAME)
    assert again > gen and rec is not None and rec.generation == again


def test_leave_removes_its_own_values_rewritten_while_it_leaves(store: Store) -> None:
    """Our own heartbeat thread may beat once more, and our record be published again, between
    the read and the delete: those are still ours and go."""
    racing = Interleaving(store)
    directory = Directory(racing, NS, None)
    gen = _start(directory)
    again = record(name=NAME, namespace=NS, generation=gen, agent=f"{NAME}#{gen}", revision=2)
    racing.after_read(directory.key("peers", NAME), lambda: directory.publish(again))
    racing.after_read(directory.key("hb", NAME), lambda: directory.heartbeat(NAME, gen))

    directory.leave(NAME, gen)

    assert sorted(racing.fired) == sorted([directory.key("peers", NAME), directory.key("hb", NAME)])
    assert store.try_get(directory.key("peers", NAME)) is None
    assert store.try_get(directory.key("hb", NAME)) is None


def test_leave_gives_up_on_a_heartbeat_rewritten_at_every_read(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that rewrites the heartbeat after every read (a store writer, an old incarnation
    beating on) cannot hold ``leave`` (and so ``close``) for ever: it gives up, warning."""
    racing = Interleaving(store)
    directory = Directory(racing, NS, None)
    gen = _start(directory)
    key = directory.key("hb", NAME)
    beats = []

    def beat_again() -> None:
        beats.append(1)
        directory.heartbeat(NAME, gen, at=float(len(beats)))
        racing.after_read(key, beat_again)

    racing.after_read(key, beat_again)
    with caplog.at_level(logging.WARNING, logger="transport.peers.directory"):
        directory.leave(NAME, gen)

    assert len(beats) == peers.LEAVE_TRIES
    assert "rewritten" in caplog.text and key in caplog.text
    assert directory.last_heartbeat(NAME) == (gen, float(peers.LEAVE_TRIES))
    assert store.try_get(directory.key("peers", NAME)) is None


def test_an_older_incarnation_that_leaves_late_never_lowers_the_left_mark(
    store: Store, secret: bytes | None
) -> None:
    """Generation 1 reads its record and judges it its own; before it marks that it left,
    generation 2 starts and leaves (mark: 2). Generation 1's mark comes late and must not put
    the mark back to 1: a reader would take generation 2's notifications as a live peer's."""
    racing = Interleaving(store)
    old = Directory(racing, NS, secret)
    new = Directory(store, NS, secret)
    first = _start(old)
    second: list[int] = []

    def newer_comes_and_goes() -> None:
        second.append(_start(new))
        new.leave(NAME, second[0])

    racing.after_read(old.key("peers", NAME), newer_comes_and_goes)

    old.leave(NAME, first)

    assert racing.fired and second and second[0] > first
    assert new.left(NAME) == second[0], "the left mark went back to an older incarnation"
    assert store.try_get(new.key("peers", NAME)) is None


def test_a_newer_mark_written_while_the_old_one_raises_its_own_stays(
    store: Store, secret: bytes | None
) -> None:
    """The newer incarnation starts and leaves right after the old one read the mark (to raise
    it): the old one's conditional write loses, and the newer mark stays."""
    racing = Interleaving(store)
    old = Directory(racing, NS, secret)
    new = Directory(store, NS, secret)
    first = _start(old)
    second: list[int] = []

    def newer_comes_and_goes() -> None:
        second.append(_start(new))
        new.leave(NAME, second[0])

    racing.after_read(old.key("left", NAME), newer_comes_and_goes)

    old.leave(NAME, first)

    assert racing.fired == [old.key("left", NAME)] and second and second[0] > first
    assert new.left(NAME) == second[0], "the left mark went back to an older incarnation"


def test_the_left_mark_rises_over_an_older_one_and_garbage(
    store: Store, secret: bytes | None
) -> None:
    directory = Directory(store, NS, secret)
    first = _start(directory)
    directory.leave(NAME, first)
    assert directory.left(NAME) == first
    second = _start(directory)
    directory.leave(NAME, second)
    assert directory.left(NAME) == second
    store.set(directory.key("left", NAME), b"\xc1garbage")
    third = _start(directory)
    directory.leave(NAME, third)
    assert directory.left(NAME) == third


def test_leave_after_the_store_lost_the_record_still_marks_it_and_removes_the_heartbeat(
    store: Store, secret: bytes | None
) -> None:
    """A store restarted empty lost the record; the heartbeat thread wrote a beat since. The
    incarnation that leaves still marks that it left and takes its heartbeat along."""
    directory = Directory(store, NS, secret)
    gen = _start(directory)
    store.delete(directory.key("peers", NAME))

    directory.leave(NAME, gen)

    assert directory.left(NAME) == gen
    assert directory.last_heartbeat(NAME) is None
    assert not store.exists(directory.key("hb", NAME))
