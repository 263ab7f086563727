"""A closing subscriber against its own periodic check of its group entry, on every store.

``WeightSubscriber.close`` leaves the group (its entry and declared layout go) while its worker
may be in the middle of ``check_in``, the check that puts back an entry the store lost: a check
that read the entry before the leave and writes after it puts the entry back, and the closed
subscriber stays in the group (the publisher keeps planning it) with its regions withdrawn.
The check is held right after its read of the entry by a store whose ``try_get`` runs a hook
(installed on the store object, undone by ``monkeypatch``), and released once the close has
left the group, or once the close says it waits for that check. No timing involved."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import transport
from transport import Store
from transport.weights.group.group_directory import GroupDirectory

pytestmark = [pytest.mark.stores, pytest.mark.unit, pytest.mark.timeout(60)]

NS = "sub-close-race"
GROUP = "policy"
CLOSER = "test-closer"  # the thread that closes the subscriber
SUBSCRIBER_LOG = "transport.weights.subscribing.membership"
#: loopback agents live in one table per process: each Transport of these tests its own name
_names = itertools.count()


class StoreCalls:
    """Hooks after the calls of ``store`` (installed on the object itself, undone by
    ``monkeypatch``, so every Transport on ``store`` goes through them): each function in
    ``after`` runs as ``f(method, key, result)`` after a call, in the calling thread."""

    METHODS = ("try_get", "exists", "set", "compare_set", "compare_delete", "add")

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.after: list[Callable[[str, str, object], None]] = []
        for method in self.METHODS:
            monkeypatch.setattr(store, method, self._hooked(method, getattr(store, method)))

    def _hooked(self, method: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def hooked(key: str, *args: Any, **kwargs: Any) -> Any:
            result = call(key, *args, **kwargs)
            for hook in list(self.after):
                hook(method, key, result)
            return result

        return hooked


class _Said(logging.Handler):
    """Sets ``event`` once a record containing ``words`` is logged."""

    def __init__(self, words: str, event: threading.Event) -> None:
        super().__init__(logging.DEBUG)
        self.words, self.event = words, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.event.set()


@contextmanager
def said(words: str, event: threading.Event) -> Iterator[None]:
    """``event`` is set once the subscriber logs ``words`` (at any level) inside the block."""
    logger = logging.getLogger(SUBSCRIBER_LOG)
    handler, level = _Said(words, event), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _thread() -> str:
    return threading.current_thread().name


def _transport(store: Store, role: str) -> transport.Transport:
    return transport.Transport(
        f"sub-close-race-{role}-{next(_names)}",
        store=store,
        namespace=NS,
        backend="loopback",
        timeout=10,
    )


def test_a_check_of_the_entry_in_flight_as_the_subscriber_closes_does_not_put_it_back(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = StoreCalls(store, monkeypatch)
    gen, trainer = _transport(store, "gen"), _transport(store, "trainer")
    try:
        weights = {"w": torch.arange(1024, dtype=torch.float32)}
        pub = transport.WeightPublisher(trainer, weights, group=GROUP)
        sub = transport.WeightSubscriber(gen, {"w": torch.zeros(1024)}, group=GROUP)
        first = pub.publish(1, timeout=10).wait(10)
        assert first.done == [gen.name]
        prefix = f"transport/{NS}/groups/{GROUP}/"
        entry, layout = prefix + f"sub/{gen.name}", prefix + f"layout/{gen.name}"
        reached, left, release = (threading.Event() for _ in range(3))

        def hold(method: str, key: str, result: object) -> None:
            """The worker's check of our entry, right after it read it (ours, as written)."""
            if (
                method == "try_get"
                and key == entry
                and result is not None
                and _thread().startswith("transport-ws-sub-")
                and not reached.is_set()
            ):
                reached.set()
                assert release.wait(30), "the held check was never released"

        def watch_leave(method: str, key: str, result: object) -> None:
            """The close removed our layout: the last thing the group's leave deletes."""
            if method == "compare_delete" and key == layout and result and _thread() == CLOSER:
                left.set()

        calls.after += [hold, watch_leave]
        assert reached.wait(30), "the subscriber never checked its entry"
        closer = threading.Thread(target=sub.close, name=CLOSER)
        with said("waits for the check of its entry", release):
            closer.start()
            try:
                # the close leaves (the check then goes on, and must not put the entry back), or
                # says it waits for the check (which ends, then the close leaves): either releases
                assert left.wait(30), "close did not leave the group"
            finally:
                release.set()
                closer.join(30)
        assert not closer.is_alive(), "close did not return"

        reader = GroupDirectory(store, NS, GROUP)
        assert reader.entry(gen.name) is None, "the closed subscriber's entry came back"
        assert store.try_get(layout) is None, "the closed subscriber's layout came back"
        second = pub.publish(2, timeout=10).wait(10)
        assert gen.name not in second.status, (
            f"the publisher planned the closed subscriber: {second.status} {second.reasons}"
        )
        assert gen.name not in pub.subscribers()
        pub.close()
    finally:
        gen.close()
        trainer.close()
