"""A store writer without the namespace's secret against a weight group, from the attacker's
side: its own client of the store (no Transport, no secret), writing the values that decide
where bytes land, to subscribers and publishers in real processes with a secret.

* a staging subscriber's entry rewritten to ``inplace``, one slot: the publisher would write the
  slot the subscriber reads (torn weights);
* a subscriber's declared layout rewritten to map ``l0.q`` from ``l0.o`` (the same shape), or a
  tensor-parallel generator's to the other TP rank's shards;
* a subscriber's entry and a generator's layout of an older incarnation put back (validly
  signed values, replayed).

Each forged value is written while its victim is stopped (SIGSTOP), so that the victim cannot
put its own value back before the publisher reads the forged one. The assertions are about the
victims: the publisher never acts on a forged value (it is logged as ignored), and once the
victim runs again the next versions complete with exactly the right bytes everywhere.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

import transport
from helpers import internals
from helpers.polling import wait_until
from helpers.shard_peer import (
    GeneratorProcess,
    dest_layout,
    full_weights,
    model_spec,
    shard_of,
    source_layout,
)
from helpers.ws_peer import make_tensors, spec_of
from transport import Store, store_from_url
from transport.security import signed
from transport.weights import ShardedPublisher, full_copy
from transport.weights.group.lease import Lease
from transport.weights.layouts.encoding import encode_dest

pytestmark = pytest.mark.timeout(120)

SECRET = b"forged-store-values"
PREFIX = "transport/default/groups/policy/"
SPEC = spec_of(3, 4096)
MODEL = model_spec(hidden=64, layers=1, vocab=256)


@pytest.fixture
def outsider(tcp_store: Store) -> Iterator[Store]:
    """A plain client of the test's store: what any process that reaches the store has."""
    raw = store_from_url(tcp_store.url)
    yield raw
    raw.close()


@pytest.fixture
def trainer(tcp_store: Store) -> Iterator[transport.Transport]:
    with transport.Transport("trainer", store=tcp_store, timeout=30, secret=SECRET) as t:
        yield t


@pytest.fixture
def generators(tcp_store: Store) -> Iterator[Any]:
    """``generators(name, kind)`` starts a generator with a secret (``wait=False`` to start
    several at once); every one is stopped at the end."""
    made: list[GeneratorProcess] = []

    def start(name: str, kind: str, wait: bool = True) -> GeneratorProcess:
        g = GeneratorProcess(name, tcp_store.url, MODEL, kind, wait=wait, secret=SECRET)
        made.append(g)
        return g

    yield start
    for g in reversed(made):
        g.stop()


def _publish_plain(pub: Any, tensors: dict[str, Any], version: int, timeout: float = 20) -> Any:
    for t in tensors.values():
        t.fill_(version)
    return pub.publish(version, timeout=timeout).wait(timeout + 10)


def _member(pub: Any, name: str) -> bool:
    """Whether ``pub``, having read the group, serves ``name``."""
    pub.refresh()
    return name in pub.subscribers()


def _served_plain(pub: Any, tensors: dict[str, Any], version: int, subs: list[Any]) -> None:
    r = _publish_plain(pub, tensors, version)
    assert r.done == sorted(s.name for s in subs), r.reasons
    for s in subs:
        assert s.call("wait_for_version", version, 10) == version
        assert s.call("apply") == version
        assert s.call("live") == {n: (float(version), float(version)) for n in SPEC}


def test_a_forged_entry_never_makes_the_publisher_write_a_staging_slot_in_place(
    trainer, spawn, outsider, caplog
):
    a = spawn("sub", "gen-a", SPEC, wait=False, secret=SECRET)
    b = spawn("sub", "gen-b", SPEC, wait=False, secret=SECRET)
    a.started()
    b.started()
    key = PREFIX + "sub/gen-a"
    entry = msgpack.packb(
        {"v": 2, "gen": a.generation, "inst": 1, "mode": "inplace", "slots": 1, "relay": False}
    )
    # as the store held entries before they were signed, then as an envelope without a MAC
    forms = [entry, signed.encode(None, key, "gen-a", a.generation, entry)]
    tensors = make_tensors(SPEC)
    version = 0
    with transport.WeightPublisher(trainer, tensors, group="policy") as pub:
        for forged in forms:
            a.signal(signal.SIGSTOP)  # it cannot put its own entry back meanwhile
            outsider.set(key, forged)
            outsider.add(PREFIX + "epoch", 1)  # publishers: read the group again
            caplog.clear()
            with caplog.at_level(logging.WARNING, "transport"):
                version += 1
                r = _publish_plain(pub, tensors, version, timeout=5)
            # not a member while its entry is not its own: nothing is written into it
            assert r.status == {"gen-b": "done"}, r.reasons
            assert f"ignoring the group entry {key}" in caplog.text
            a.signal(signal.SIGCONT)
            wait_until(lambda f=forged: outsider.try_get(key) != f, 20, "its own entry back")
            wait_until(lambda: _member(pub, "gen-a"), 20, "gen-a a member again")
            for _ in range(2):
                version += 1
                _served_plain(pub, tensors, version, [a, b])
    assert a.call("violations") == [] and b.call("violations") == []


def test_without_a_secret_a_forged_in_place_entry_of_a_one_slot_subscriber_is_refused(
    tcp_store, spawn, outsider, caplog
):
    """No secret: a store writer rewrites a one-slot staging subscriber's entry to in place,
    with its own generation and instance (one slot: as many as its record exposes), before the
    publisher first plans it. Only a record that marks its memory in place is written in place:
    the subscriber is left out, saying why, until its own entry is back, and every version it
    then holds (and applies) is whole."""
    a = spawn("sub", "gen-a", SPEC, wait=False, slots=1)
    b = spawn("sub", "gen-b", SPEC, wait=False)
    a.started()
    b.started()
    key = PREFIX + "sub/gen-a"
    own = outsider.try_get(key)
    assert own is not None
    body = msgpack.unpackb(signed.decode(None, key, own, "its entry").body)
    assert body["mode"] == "staging" and body["slots"] == 1, body
    forged = signed.encode(
        None, key, "gen-a", a.generation, msgpack.packb(body | {"mode": "inplace"})
    )
    a.signal(signal.SIGSTOP)  # it cannot put its own entry back meanwhile
    outsider.set(key, forged)
    tensors = make_tensors(SPEC)
    with transport.Transport("trainer", store=tcp_store, timeout=30) as t:
        with transport.WeightPublisher(t, tensors, group="policy") as pub:
            with caplog.at_level(logging.ERROR, "transport"):
                r = _publish_plain(pub, tensors, 1, timeout=5)
            assert r.status == {"gen-a": "excluded", "gen-b": "done"}, r.reasons
            why = r.reasons["gen-a"]
            assert "group entry says inplace, its record exposes staging slots" in why, why
            a.signal(signal.SIGCONT)
            wait_until(lambda: outsider.try_get(key) != forged, 20, "its own entry back")
            wait_until(lambda: _member(pub, "gen-a") and not pub.refresh(), 20, "it planned again")
            for version in (2, 3, 4):
                _served_plain(pub, tensors, version, [a, b])
    assert a.call("violations") == [] and b.call("violations") == []


def test_an_entry_of_an_older_incarnation_put_back_is_refused_and_replaced(
    trainer, spawn, outsider
):
    key = PREFIX + "sub/gen-a"
    old = spawn("sub", "gen-a", SPEC, secret=SECRET)
    replay = outsider.try_get(key)  # its entry, validly signed
    assert replay is not None
    old.stop()
    new = spawn("sub", "gen-a", SPEC, secret=SECRET)  # restarted: the next generation
    assert new.generation > old.generation
    new.signal(signal.SIGSTOP)  # it cannot put its own entry back meanwhile
    outsider.set(key, replay)
    outsider.add(PREFIX + "epoch", 1)
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, group="policy") as pub:
        r = _publish_plain(pub, tensors, 1, timeout=5)
        assert r.excluded == ["gen-a"], r.reasons
        why = r.reasons["gen-a"]
        # planned again until the deadline; the replayed entry's incarnation is suspect then
        # (a newer one beats in its place), or its record says another generation
        assert str(new.generation) in why and str(old.generation) in why, why
        assert "record is of generation" in why or "beats in the place of" in why, why
        new.signal(signal.SIGCONT)
        wait_until(lambda: outsider.try_get(key) != replay, 20, "its own entry back")
        wait_until(lambda: _member(pub, "gen-a") and not pub.refresh(), 20, "it planned again")
        for version in (2, 3):
            _served_plain(pub, tensors, version, [new])


def _sharded(trainer: transport.Transport) -> tuple[Any, dict[str, Any], Any]:
    src = source_layout(MODEL, 1)
    shards = shard_of(src, full_weights(MODEL, 0), 0)
    return src, shards, ShardedPublisher(trainer, shards, src, 0, group="policy")


def _publish_sharded(
    src: Any, shards: dict[str, Any], pub: Any, version: int, timeout: float = 20
) -> Any:
    for n, t in shard_of(src, full_weights(MODEL, version), 0).items():
        shards[n].copy_(t)
    return pub.publish(version, timeout=timeout).wait(timeout + 10)


def _served_sharded(
    src: Any, shards: dict[str, Any], pub: Any, version: int, gens: list[Any]
) -> None:
    r = _publish_sharded(src, shards, pub, version)
    assert r.done == sorted(g.name for g in gens), r.reasons
    for g in gens:
        got = g.call("check", version, 30)
        assert got["version"] == version and got["bad"] == [], (g.name, got)


def test_without_a_secret_forged_leases_never_complete_a_version_with_fewer_ranks_parts(
    tcp_store, outsider
):
    """No secret, a trainer of two ranks. Right after rank 0 puts its lease back at a publish,
    a store writer rewrites it to say the trainer has one rank, and deletes rank 1's lease and
    the count of ranks. The generator takes the number of ranks from the ranks' own records
    (each marks which rank of how many it is): rank 0's parts alone never make version 1, even
    when the generator read the forged leases before they landed; once rank 1 publishes it
    too, it completes, every tensor right."""
    src = source_layout(MODEL, 2)
    ns = "transport/default/groups/policy/"
    with (
        transport.Transport("trainer-0", store=tcp_store, timeout=30) as t0,
        transport.Transport("trainer-1", store=tcp_store, timeout=30) as t1,
    ):
        shards = [shard_of(src, full_weights(MODEL, 0), r) for r in range(2)]
        pubs = [
            ShardedPublisher(t, shards[r], src, r, group="policy") for r, t in enumerate((t0, t1))
        ]
        gen = GeneratorProcess("gen-full", tcp_store.url, MODEL, "full")
        try:
            one_rank = Lease("trainer-0", t0.generation, 0, 1, pubs[0].digest).encode()

            forged: list[bool] = []

            def forge() -> None:
                if forged:  # once: rank 0's later checks put its own values back
                    return
                forged.append(True)
                key = ns + "lease"
                outsider.set(key, signed.encode(None, key, "trainer-0", t0.generation, one_rank))
                outsider.delete(ns + "lease/1")
                outsider.delete(ns + "ranks")
                # rank 0 writes only once the generator has read the forged leases: a read that
                # started after the forgery, and ended (the next one started)
                for _ in range(2):
                    due = gen.call("upstream_reads")
                    wait_until(lambda d=due: gen.call("upstream_reads") != d, 30, "a read")
                assert gen.call("upstream_ranks") == {"trainer-0": 0}

            internals.after_lease_ensure(pubs[0], forge)
            for r in range(2):
                for n, x in shard_of(src, full_weights(MODEL, 1), r).items():
                    shards[r][n].copy_(x)
            first = pubs[0].publish(1, timeout=60)
            wait_until(lambda: gen.call("parts") == [(1, [0])], 30, "rank 0's parts of version 1")
            assert gen.call("held")["version"] == -1  # not complete: rank 1's parts are missing
            pubs[0].refresh()  # rank 0 puts back its lease and the count (rank 1 checks them)
            second = pubs[1].publish(1, timeout=60)  # rank 1 puts its lease back, then writes
            for handle in (first, second):
                r = handle.wait(90)
                assert r.done == ["gen-full"], r.reasons
            got = gen.call("check", 1, 30)
            assert got["version"] == 1 and got["bad"] == [], got
        finally:
            gen.stop()
            for pub in pubs:
                pub.close()


def test_a_forged_layout_never_maps_one_tensor_from_another(trainer, generators, outsider, caplog):
    full, tp = (
        generators("gen-full", "full", wait=False),
        generators("gen-tp", "tp0of2", wait=False),
    )
    full.started(120)
    tp.started(120)
    for g in (full, tp):
        g.signal(signal.SIGSTOP)  # neither can put its own layout back meanwhile
    src = source_layout(MODEL, 1)
    # q from o and o from q (the same shape), as the store held layouts before they were signed
    rest = [n for n in MODEL if n not in ("l0.q", "l0.o")]
    swapped = encode_dest(full_copy(src, rest, rename={"l0.q": "l0.o", "l0.o": "l0.q"}))
    # the other TP rank's shards (the same shapes), as an envelope without a MAC
    key = PREFIX + "layout/gen-tp"
    other = signed.encode(
        None, key, "gen-tp", tp.generation, encode_dest(dest_layout(MODEL, "tp1of2"))
    )
    forged = {PREFIX + "layout/gen-full": swapped, key: other}
    for k, raw in forged.items():
        outsider.set(k, raw)
    src, shards, pub = _sharded(trainer)
    try:
        with caplog.at_level(logging.WARNING, "transport"):
            r = _publish_sharded(src, shards, pub, 1, timeout=5)
        assert r.excluded == ["gen-full", "gen-tp"], r.reasons
        for name in r.excluded:
            assert "no declared layout" in r.reasons[name], r.reasons
        for k in forged:
            assert f"ignoring the declared layout {k}" in caplog.text
        for g in (full, tp):
            g.signal(signal.SIGCONT)
        for k, raw in forged.items():
            wait_until(lambda k=k, raw=raw: outsider.try_get(k) != raw, 20, f"{k} put back")
        for version in (2, 3):
            _served_sharded(src, shards, pub, version, [full, tp])
    finally:
        pub.close()


def test_a_layout_of_an_older_incarnation_put_back_is_ignored(
    trainer, generators, outsider, caplog
):
    key = PREFIX + "layout/gen-tp"
    old = generators("gen-tp", "tp0of2")
    replay = outsider.try_get(key)  # its layout, validly signed: TP rank 0 of 2
    assert replay is not None
    old.stop()
    new = generators("gen-tp", "tp1of2")  # restarted as TP rank 1: the same shapes
    assert new.generation > old.generation
    new.signal(signal.SIGSTOP)  # it cannot put its own layout back meanwhile
    outsider.set(key, replay)
    src, shards, pub = _sharded(trainer)
    try:
        with caplog.at_level(logging.WARNING, "transport"):
            r = _publish_sharded(src, shards, pub, 1, timeout=5)
        assert r.excluded == ["gen-tp"] and "no declared layout" in r.reasons["gen-tp"], r.reasons
        assert "an older incarnation's value, put back?" in caplog.text
        new.signal(signal.SIGCONT)
        wait_until(lambda: outsider.try_get(key) != replay, 20, "its own layout put back")
        for version in (2, 3):
            _served_sharded(src, shards, pub, version, [new])
    finally:
        pub.close()
