"""``GroupDirectory`` against a restart of a subscriber under the same name, on every store.

A leaving subscriber reads its entry, judges it its own, and deletes its entry and declared
layout; a newer incarnation of the name (or a later subscriber of the same Transport) that
writes its own between that read and that delete must keep them, or the publisher never plans
it until it joins again. Likewise an old incarnation that is still running (frozen, then
resumed) checks in and must not put its values back over the newer one's. The newer one's
writes are put exactly between the read and the write by a store whose ``try_get`` runs them
right after reading the key (no timing involved)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from helpers.loopback_net import LoopbackNet
from transport import Store
from transport.contract import SignedStore
from transport.security import signed
from transport.security.sealing import keys_for
from transport.weights.group.group_directory import GroupDirectory
from transport.weights.group.lease import PublisherLease, ranks_key

pytestmark = [pytest.mark.stores, pytest.mark.timeout(60)]

NS = "group-leave-race"
GROUP = "policy"
NAME = "gen-0"
ENTRY = ("staging", 2, False)  # mode, slots, relay


class ReadHooks:
    """``store`` as it is, except that right after its ``try_get`` reads a key given to
    :meth:`after_read`, the function given with it runs (once): what another process does
    between a read and the write the reader decides on. Installed on the store object itself
    (undone by ``monkeypatch``), so every directory made on ``store`` goes through it."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self._read = store.try_get
        self._hooks: dict[str, Callable[[], None]] = {}
        self.fired: list[str] = []
        monkeypatch.setattr(store, "try_get", self._try_get)

    def after_read(self, key: str, action: Callable[[], None]) -> None:
        self._hooks[key] = action

    def _try_get(self, key: str) -> bytes | None:
        raw = self._read(key)
        action = self._hooks.pop(key, None)
        if action is not None:
            self.fired.append(key)
            action()
        return raw


@pytest.fixture(params=[None, b"the-namespace-secret"], ids=["open", "secret"])
def secret(request: pytest.FixtureRequest) -> bytes | None:
    return request.param


def _directory(
    store: Store, secret: bytes | None, generation: int, instance: int = 1
) -> GroupDirectory:
    """The group directory of incarnation ``generation`` of NAME, subscriber ``instance``."""
    keys = keys_for(secret, NS) if secret else None
    return GroupDirectory(SignedStore(store, keys, NAME, generation), NS, GROUP, instance)


def _subscribe(directory: GroupDirectory, layout: bytes) -> None:
    """What a subscriber does as it starts: declare its layout, then join."""
    directory.declare_layout(layout)
    directory.join(*ENTRY)


def _key(what: str) -> str:
    return f"transport/{NS}/groups/{GROUP}/{what}/{NAME}"


def _held(store: Store, generation: int, instance: int, layout: bytes) -> None:
    """Assert that the store holds the entry and the layout of that incarnation and instance."""
    reader = GroupDirectory(store, NS, GROUP)
    entry = reader.entry(NAME)
    assert entry is not None, f"the entry of {NAME}#{generation} went"
    assert (entry.generation, entry.instance) == (generation, instance)
    assert reader.layout(NAME, generation) == layout, f"the layout of {NAME}#{generation} went"


@pytest.mark.parametrize("writes", ["entry and layout", "layout"])
def test_a_newer_incarnation_that_writes_while_the_old_one_leaves_keeps_its_values(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch, writes: str
) -> None:
    """``writes``: what the newer incarnation has written right after the old one read its
    entry (a subscriber declares its layout, then joins)."""
    hooks = ReadHooks(store, monkeypatch)
    old, new = _directory(store, secret, 1), _directory(store, secret, 2)
    _subscribe(old, b"old layout")
    epoch = old.epoch()

    def newer() -> None:
        new.declare_layout(b"new layout")
        if writes == "entry and layout":
            new.join(*ENTRY)

    hooks.after_read(_key("sub"), newer)
    old.leave()

    assert hooks.fired == [_key("sub")]
    reader = GroupDirectory(store, NS, GROUP)
    assert reader.layout(NAME, 2) == b"new layout", "the newer subscriber's layout went"
    if writes == "entry and layout":
        _held(store, 2, 1, b"new layout")
        assert old.epoch() == epoch + 1  # the newer one's join; the old one removed nothing
    else:
        assert reader.entry(NAME) is None  # the old one's entry did go
        assert old.epoch() > epoch


def test_a_newer_incarnation_that_declares_while_the_old_one_removes_its_layout_keeps_it(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newer one's writes come right after the old one read its layout (its entry gone)."""
    hooks = ReadHooks(store, monkeypatch)
    old, new = _directory(store, secret, 1), _directory(store, secret, 2)
    _subscribe(old, b"old layout")
    hooks.after_read(_key("layout"), lambda: _subscribe(new, b"new layout"))

    old.leave()

    assert hooks.fired == [_key("layout")]
    _held(store, 2, 1, b"new layout")


def test_a_later_subscriber_of_the_same_transport_keeps_its_values(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same incarnation, a later subscriber (instance): its entry differs by the instance
    alone, and its layout is not the one the first declared."""
    hooks = ReadHooks(store, monkeypatch)
    first, later = _directory(store, secret, 1, 1), _directory(store, secret, 1, 2)
    _subscribe(first, b"first layout")
    hooks.after_read(_key("sub"), lambda: _subscribe(later, b"later layout"))

    first.leave()

    assert hooks.fired == [_key("sub")]
    _held(store, 1, 2, b"later layout")


def test_leave_removes_the_entry_and_layout_nobody_replaced(
    store: Store, secret: bytes | None
) -> None:
    directory = _directory(store, secret, 1)
    _subscribe(directory, b"a layout")
    epoch = directory.epoch()
    assert directory.entry(NAME) is not None and directory.layout(NAME, 1) == b"a layout"

    directory.leave()

    assert directory.entry(NAME) is None and directory.layout(NAME, 1) is None
    assert not store.exists(_key("sub")) and not store.exists(_key("layout"))
    assert directory.epoch() == epoch + 1
    assert directory.names() == [NAME]  # the membership index only grows
    # the name joins again after it
    again = _directory(store, secret, 2)
    _subscribe(again, b"another layout")
    _held(store, 2, 1, b"another layout")


def test_an_old_incarnation_that_checks_in_leaves_the_newer_ones_values(
    store: Store, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted subscriber whose old process still runs (frozen, then resumed): the old one
    finds an entry that is not its own, but it is the newer incarnation's."""
    old, new = _directory(store, secret, 1), _directory(store, secret, 2)
    _subscribe(old, b"old layout")
    _subscribe(new, b"new layout")

    with caplog.at_level(logging.WARNING, logger="transport.weights.group"):
        for full in (True, False):
            assert old.check_in(*ENTRY, b"old layout", full) == ""

    _held(store, 2, 1, b"new layout")
    assert "a newer incarnation" in caplog.text and _key("sub") in caplog.text
    assert new.check_in(*ENTRY, b"new layout", True) == ""  # nothing for the newer one to fix


@pytest.mark.parametrize("lost", ["sub", "layout"])
def test_an_old_incarnation_that_checks_in_while_a_newer_one_joins_leaves_its_values(
    store: Store, secret: bytes | None, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """The store lost the old one's entry or layout; the old one reads its entry (missing, or
    its own), and the newer one declares and joins before the old one puts its values back."""
    hooks = ReadHooks(store, monkeypatch)
    old, new = _directory(store, secret, 1), _directory(store, secret, 2)
    _subscribe(old, b"old layout")
    store.delete(_key(lost))
    hooks.after_read(_key("sub"), lambda: _subscribe(new, b"new layout"))

    assert old.check_in(*ENTRY, b"old layout", True) == ""

    assert hooks.fired == [_key("sub")]
    _held(store, 2, 1, b"new layout")


@pytest.mark.parametrize("put_back", ["nothing", "older", "garbage"])
def test_check_in_puts_back_an_entry_the_store_lost_or_replaced(
    store: Store, secret: bytes | None, put_back: str
) -> None:
    """What ``check_in`` is for, still: a missing entry, an older incarnation's put back, or
    garbage in its place is replaced by this incarnation's own (and its layout with it)."""
    older, ours = _directory(store, secret, 1), _directory(store, secret, 2)
    _subscribe(older, b"old layout")
    replay = store.try_get(_key("sub"))
    assert replay is not None
    _subscribe(ours, b"our layout")
    store.delete(_key("layout"))
    if put_back == "nothing":
        store.delete(_key("sub"))
    else:
        store.set(_key("sub"), replay if put_back == "older" else b"\xc1garbage")

    why = ours.check_in(*ENTRY, b"our layout", False)

    assert f"our entry {_key('sub')} is missing or not the one we wrote" in why
    _held(store, 2, 1, b"our layout")
    assert ours.check_in(*ENTRY, b"our layout", True) == ""


@pytest.mark.unit
def test_a_publisher_puts_its_count_of_ranks_back_only_over_what_it_read(
    loopback_net: LoopbackNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule for the lease's count of ranks: rank 0's publisher that finds it lost at a
    publish writes it back with ``compare_set`` of what it read, so a count another writer puts
    there in between (a publisher that took the lease over meanwhile) stays."""
    t = loopback_net.make("trainer")
    lease = PublisherLease(t, GROUP)
    lease.acquire()
    key = ranks_key(t.namespace, GROUP)
    theirs = signed.encode(None, key, "trainer-b", 7, b"1")
    t.store.delete(key)
    hooks = ReadHooks(t.store, monkeypatch)
    hooks.after_read(key, lambda: t.store.set(key, theirs))

    lease.ensure()

    assert hooks.fired == [key]
    assert t.store.try_get(key) == theirs
    lease.release()
