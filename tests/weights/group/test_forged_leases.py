"""A store writer against a sharded trainer's leases and rank count, from the attacker's side:
the raw store object that every loopback Transport of the test shares, written without any
Transport and without the namespace's secret (what a process that can reach Redis does).

With a secret, a forged world of one rank (``ranks`` and a lease of world 1 for rank 0) would let
a subscriber complete a version with rank 0's parts next to another version's; a lease of an
older incarnation put back (a replay of a validly signed value) would stop the live rank 0 or
hide rank 1. The assertions are about the victims: every subscriber completes every version with
exactly the bytes of the full weights of that version, and each forged value is logged as
ignored. Without a secret the same writer can set what readers believe, and garbage anywhere in
a group stops nobody."""

from __future__ import annotations

import logging

import msgpack
import pytest
import torch

import transport
from helpers.loopback_net import LoopbackNet
from helpers.polling import wait_until
from helpers.shard_peer import shard_of
from transport.security import signed
from transport.weights import ShardedPublisher, SourceLayout
from transport.weights.group.lease import FREE, Lease
from transport.weights.layouts.encoding import source_digest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SECRET = b"forged-values-secret"
SHAPES = {"q": (64, 64), "o": (64, 64), "up": (96, 64), "norm": (64,)}
DIMS = {"o": 1, "norm": None}


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


class _Trainer:
    """Two ranks of a sharded trainer, each on its own Transport."""

    def __init__(self, net: LoopbackNet, **options: object) -> None:
        self.src = SourceLayout.split(2, {n: (s, torch.float32) for n, s in SHAPES.items()}, DIMS)
        full = _full(0)
        self.shards = [shard_of(self.src, full, r) for r in range(2)]
        self.ts = [net.make(f"trainer-{r}", **options) for r in range(2)]
        self.pubs = [
            ShardedPublisher(t, self.shards[r], self.src, r, group="policy")
            for r, t in enumerate(self.ts)
        ]

    def step(self, version: int) -> dict[str, torch.Tensor]:
        full = _full(version)
        for r, mine in enumerate(self.shards):
            for n, t in shard_of(self.src, full, r).items():
                mine[n].copy_(t)
        return full

    def publish(self, version: int, first: int = 0, timeout: float = 20.0) -> list[object]:
        """Every rank publishes ``version``, rank ``first`` before the other."""
        order = [first, 1 - first]
        handles = {r: self.pubs[r].publish(version, timeout=timeout) for r in order}
        return [handles[r].wait(timeout + 10) for r in range(2)]


def _sub(net: LoopbackNet, role: str, **options: object):
    live = {n: torch.zeros(s) for n, s in SHAPES.items()}
    return transport.WeightSubscriber(net.make(role, **options), live, group="policy"), live


def _served(trainer: _Trainer, version: int, subs, first: int = 0) -> None:
    """``version`` reaches every subscriber of ``subs``, every byte of it."""
    full = trainer.step(version)
    names = sorted(s.transport.name for s, _ in subs)
    for result in trainer.publish(version, first):
        assert result.done == names, result
    for s, live in subs:
        s.wait_for_version(version, 10)
        assert s.apply() == version
        for n in SHAPES:
            assert torch.equal(live[n], full[n]), (s.transport.name, n)


def _prefix(t: transport.Transport) -> str:
    return f"transport/{t.namespace}/groups/policy/"


def test_a_forged_world_of_one_rank_never_completes_a_version_with_half_its_parts(
    loopback_net, caplog
):
    trainer = _Trainer(loopback_net, secret=SECRET)
    a = _sub(loopback_net, "gen-a", secret=SECRET)
    _served(trainer, 1, [a])
    store, prefix, t0 = loopback_net.store, _prefix(trainer.ts[0]), trainer.ts[0]
    lease = Lease(t0.name, t0.generation, 0, 1, source_digest(trainer.src))
    # as the store held them before they were signed: a plain count and a plain lease
    store.set(prefix + "ranks", b"1")
    store.set(prefix + "lease", lease.encode())
    b = _sub(loopback_net, "gen-b", secret=SECRET)  # reads the group afresh
    with caplog.at_level(logging.WARNING, "transport"):
        _served(trainer, 2, [a, b], first=1)  # rank 1 speaks first, before rank 0 repairs
    assert f"ignoring the publisher lease {prefix}lease" in caplog.text
    # as an outsider writes them now: envelopes without a MAC, naming rank 0's holder
    for key, body in (("ranks", b"1"), ("lease", lease.encode())):
        store.set(prefix + key, signed.encode(None, prefix + key, t0.name, t0.generation, body))
    store.set(prefix + "lease/1", FREE)  # and rank 1's lease given back for it
    caplog.clear()
    c = _sub(loopback_net, "gen-c", secret=SECRET)
    with caplog.at_level(logging.WARNING, "transport"):
        _served(trainer, 3, [a, b, c], first=1)
    assert "is not signed, but this namespace has a secret" in caplog.text
    assert f"{prefix}lease" in caplog.text and f"{prefix}ranks" in caplog.text


def test_a_lease_of_an_older_incarnation_put_back_is_ignored_and_taken_back(loopback_net, caplog):
    # trainer-0's first incarnation published the group alone: a lease of world 1, signed
    old = loopback_net.make("trainer-0", secret=SECRET)
    prefix = _prefix(old)
    single = transport.WeightPublisher(old, {"w": torch.zeros(16)}, group="policy")
    replay = {k: loopback_net.store.try_get(prefix + k) for k in ("lease", "ranks")}
    assert all(replay.values())
    single.close()
    old.close()
    trainer = _Trainer(loopback_net, secret=SECRET)  # trainer-0 again: the next generation
    assert trainer.ts[0].generation > old.generation
    a = _sub(loopback_net, "gen-a", secret=SECRET)
    _served(trainer, 1, [a])
    # the outsider copies the old, validly signed values back, and removes rank 1's lease
    for key, raw in replay.items():
        loopback_net.store.set(prefix + key, raw)
    loopback_net.store.delete(prefix + "lease/1")
    b = _sub(loopback_net, "gen-b", secret=SECRET)
    with caplog.at_level(logging.WARNING, "transport"):
        _served(trainer, 2, [a, b], first=1)
    assert "an older incarnation's lease, put back?" in caplog.text  # the readers'
    assert "which is gone, in place of ours" in caplog.text  # rank 0 took its lease back
    _served(trainer, 3, [a, b])


def test_without_a_secret_a_store_writer_sets_what_readers_believe_but_stops_nobody(
    loopback_net, caplog
):
    from transport.weights.group.group_directory import GroupDirectory, GroupEntry
    from transport.weights.group.lease import GroupLeases

    trainer = _Trainer(loopback_net)
    a = _sub(loopback_net, "gen-a")
    _served(trainer, 1, [a])
    store, prefix, t0 = loopback_net.store, _prefix(trainer.ts[0]), trainer.ts[0]
    gen_a = a[0].transport
    reader = loopback_net.make("reader")
    # What it CAN do: an envelope without a MAC is what every value is without a secret, so
    # readers take a forged world of one rank, a forged entry and a forged layout as real.
    # (the entry and layout of a subscriber that is not running: a live one puts its own back)
    lease = Lease(t0.name, t0.generation, 0, 1, source_digest(trainer.src))
    entry = {"v": 2, "gen": 7, "inst": 1, "mode": "inplace", "slots": 1, "relay": True}
    forged = {
        "ranks": (t0.name, t0.generation, b"1"),
        "lease": (t0.name, t0.generation, lease.encode()),
        "sub/gen-x": ("gen-x", 7, msgpack.packb(entry)),
        "layout/gen-x": ("gen-x", 7, b"anything"),
    }
    for key, (writer, gen, body) in forged.items():
        store.set(prefix + key, signed.encode(None, prefix + key, writer, gen, body))
    store.delete(prefix + "lease/1")
    assert GroupLeases(reader, "policy").read().world == 1
    directory = GroupDirectory(reader.core.signed, reader.namespace, "policy")
    assert directory.entry("gen-x") == GroupEntry(7, 1, "inplace", 1, True)
    assert directory.layout("gen-x", 7) == b"anything"
    # What it cannot do: garbage in every value of the group stops no publish and no
    # subscriber; each is skipped with a warning, and its writer puts its own value back.
    garbage = b"\xc1garbage"
    keys = [
        "ranks",
        "lease",
        "lease/1",
        "published/0",
        "published/1",
        f"sub/{gen_a.name}",
        f"layout/{gen_a.name}",
        "epoch",
        "members/count",
        "members/1",
    ]
    for key in keys:
        store.set(prefix + key, garbage)
    with caplog.at_level(logging.WARNING, "transport"):
        full = trainer.step(2)
        results = trainer.publish(2)  # goes on: gen-a may be left out of this one
        if all(r.done == [gen_a.name] for r in results):
            a[0].wait_for_version(2, 10)
            assert a[0].apply() == 2 and all(torch.equal(a[1][n], full[n]) for n in SHAPES)
        for key in (f"sub/{gen_a.name}", f"layout/{gen_a.name}"):
            wait_until(lambda k=key: store.try_get(prefix + k) != garbage, 10, f"{key} put back")
        _served(trainer, 3, [a])
    for key in ("ranks", "lease", "lease/1", f"sub/{gen_a.name}", "epoch", "members/count"):
        assert prefix + key in caplog.text, key
