"""Relayed fan-out: subscribers forward each version along a chain or a tree, every byte arrives,
the publisher reports who wrote whom, and relays that die, freeze or leave cost their children at
most the version in flight.

Every element of every tensor of version N holds N (see test_weight_sync)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import transport
from helpers.polling import wait_until
from helpers.ws_peer import MiB, make_tensors, spec_of

SPEC = spec_of(3, MiB)  # 12 MiB in 3 tensors


def everywhere(names, value):
    return {n: (float(value), float(value)) for n in names}


def publish(pub, tensors, version, timeout=20.0):
    for t in tensors.values():
        t.fill_(version)
    return pub.publish(version, timeout=timeout).wait(timeout + 10)


def holds(sub, spec, version):
    """The subscriber completed ``version``, and after apply() its live tensors hold all of it."""
    assert sub.call("wait_for_version", version, 10) == version
    assert sub.call("apply") == version
    assert sub.call("live") == everywhere(spec, version)


def start(spawn, names, spec=SPEC, **kwargs):
    subs = [spawn("sub", n, spec, wait=False, **kwargs) for n in names]
    for s in subs:
        s.started()
    return subs


#: 16 MiB: more than socket buffers hold (a frozen relay cannot take a version in them)
BIG = spec_of(2, 2 * MiB)


@contextmanager
def stopped(relay, trainer) -> Iterator[None]:
    """``relay`` stopped (SIGSTOP) inside the block; after it, running and beating again (if it
    was stopped long enough to be suspect, it is left out until then)."""
    relay.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        relay.signal(signal.SIGCONT)
    wait_until(
        lambda: {i.name: i for i in trainer.peers()}[relay.name].suspect is None,
        30,
        f"{relay.name} beating again",
    )


def test_a_chain_forwards_every_version_and_ends_in_an_inplace_subscriber(trainer, spawn):
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"])
    (d,) = start(spawn, ["gen-d"], mode="inplace")
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        for v in range(1, 6):
            r = publish(pub, tensors, v)
            assert r.done == ["gen-a", "gen-b", "gen-c", "gen-d"], r.reasons
            # relays first (by name), the in-place subscriber last: it cannot relay
            assert r.via == {"gen-b": "gen-a", "gen-c": "gen-b", "gen-d": "gen-c"}
            for s in (a, b, c):
                holds(s, SPEC, v)
            assert d.call("wait_for_version", v, 10) == v
            assert d.call("live") == everywhere(SPEC, v)
    # the publisher wrote only the head; each relay wrote the next one
    assert a.call("writers", "ver") == ["trainer"]
    assert b.call("writers", "ver") == ["gen-a"]
    assert c.call("writers", "ver") == ["gen-b"]
    assert d.call("writers", "ver") == ["gen-c"]
    for s in (a, b, c, d):
        assert s.call("violations") == []


def test_tensors_larger_than_a_segment_are_relayed_piece_by_piece(trainer, spawn):
    """An 80 MiB tensor in the middle and a 48 MiB one at the end (segments are 32 MiB): each
    travels in pieces announced as they land, every relay forwards each piece at once, and every
    byte of every version arrives down the chain."""
    spec = {
        "a": ((1 << 20,), "float32"),
        "emb": ((20 << 20,), "float32"),
        "w": ((1 << 20,), "float32"),
        "z_head": ((12 << 20,), "float32"),
    }
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"], spec)
    (d,) = start(spawn, ["gen-d"], spec, mode="inplace")
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        for v in (1, 2, 3):
            r = publish(pub, tensors, v, timeout=60)
            assert r.done == ["gen-a", "gen-b", "gen-c", "gen-d"], r.reasons
            for s in (a, b, c):
                holds(s, spec, v)
            assert d.call("wait_for_version", v, 10) == v
            assert d.call("live") == everywhere(spec, v)
    # pieces announced by the publisher to the head, and by each relay to the next relay; the
    # in-place tail relays nothing, so its pieces come unannounced
    assert a.call("writers", "part") == ["trainer"]
    assert b.call("writers", "part") == ["gen-a"]
    assert c.call("writers", "part") == ["gen-b"]
    assert d.call("writers", "part") == []
    for s in (a, b, c, d):
        assert s.call("violations") == []


def test_a_tree_of_degree_two(trainer, spawn):
    subs = start(spawn, [f"gen-{i}" for i in range(5)])
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, fanout="tree", degree=2) as pub:
        for v in (1, 2, 3):
            r = publish(pub, tensors, v)
            assert len(r.done) == 5, r.reasons
            # the trainer writes gen-0 only; each relay writes two more
            assert r.via == {"gen-1": "gen-0", "gen-2": "gen-0", "gen-3": "gen-1", "gen-4": "gen-1"}
        for s in subs:
            holds(s, SPEC, 3)
        # the fan-out can change between publishes
        pub.fanout = "direct"
        r = publish(pub, tensors, 4)
        assert len(r.done) == 5 and r.via == {}, r.reasons
        for s in subs:
            holds(s, SPEC, 4)
        assert subs[4].call("writers", "ver") == ["gen-1", "trainer"]


def test_relays_only_serve_what_they_hold_and_only_if_they_relay(trainer, spawn):
    subset = {n: SPEC[n] for n in ("w0", "w1")}
    (part,) = start(spawn, ["gen-a-part"], spec=subset)  # first by name, but holds only two
    (full,) = start(spawn, ["gen-b-full"])
    (quiet,) = start(spawn, ["gen-0-quiet"], relay=False)  # first by name, but does not relay
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        r = publish(pub, tensors, 1)
        assert len(r.done) == 3, r.reasons
        # order: the relays by name (part, full), then the one that does not relay; full needs a
        # tensor part lacks, so the publisher writes it; quiet comes after full
        assert r.via == {"gen-0-quiet": "gen-b-full"}
    holds(part, subset, 1)
    holds(full, SPEC, 1)
    holds(quiet, SPEC, 1)
    assert full.call("writers", "ver") == ["trainer"]


def test_a_killed_relay_costs_its_child_one_version(trainer, spawn):
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"])
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        assert publish(pub, tensors, 1).done == ["gen-a", "gen-b", "gen-c"]
        b.kill()
        r = publish(pub, tensors, 2)
        assert r.status["gen-a"] == "done" and r.status["gen-b"] == "lost", r.reasons
        assert "gen-b" in r.reasons["gen-b"]
        if "gen-c" in r.via:  # gen-b was told to forward, and died: gen-c misses this version
            assert r.status["gen-c"] == "excluded" and "gen-b" in r.reasons["gen-c"], r.reasons
        else:  # telling gen-b failed already: the publisher wrote gen-c itself
            assert r.status["gen-c"] == "done", r.reasons
            holds(c, SPEC, 2)
        r = publish(pub, tensors, 3)  # the chain closes over the gap
        assert r.status == {"gen-a": "done", "gen-c": "done"}, r.reasons
        assert r.via == {"gen-c": "gen-a"}
    holds(a, SPEC, 3)
    holds(c, SPEC, 3)
    assert c.call("state")["incomplete"] is None


def test_a_frozen_relay_excludes_its_children_until_it_runs_again(trainer, spawn):
    spec = BIG
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"], spec=spec)
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        assert publish(pub, tensors, 1).done == ["gen-a", "gen-b", "gen-c"]
        holds(c, spec, 1)
        with stopped(b, trainer):
            r = publish(pub, tensors, 2, timeout=1.0)
            assert r.status == {"gen-a": "done", "gen-b": "excluded", "gen-c": "excluded"}, (
                r.reasons
            )
            assert "did not forward" in r.reasons["gen-c"]
            # while gen-b may still write gen-c's slot, nobody else is given it
            r = publish(pub, tensors, 3, timeout=1.0)
            assert r.status["gen-a"] == "done" and r.status["gen-c"] == "excluded", r.reasons
        # running again, gen-b reports that it could not forward, and beats: all are served
        r = publish(pub, tensors, 4)
        assert r.done == ["gen-a", "gen-b", "gen-c"], r.reasons
    for s in (a, b, c):
        holds(s, spec, 4)
        assert s.call("violations") == []


def test_the_chain_closes_over_a_relay_that_freezes_during_a_publish(trainer, spawn):
    """A relay frozen long enough to be suspect: its child gets the version from the publisher
    in the same publish, into the slot of the version it applied (lent), never into the slot
    the frozen relay was given; that slot stays fenced until the relay reports, so meanwhile
    each version lands in the child's lent slot, which it lends only once applied."""
    spec = BIG
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"], spec=spec)
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        assert publish(pub, tensors, 1).done == ["gen-a", "gen-b", "gen-c"]
        holds(c, spec, 1)
        fenced = c.call("staging")["slot_versions"].index(-1)  # the slot gen-b will be given
        with stopped(b, trainer):
            r = publish(pub, tensors, 2, timeout=30.0)
            assert r.status == {"gen-a": "done", "gen-b": "excluded", "gen-c": "done"}, r.reasons
            assert r.reasons["gen-b"].startswith("suspect"), r.reasons
            assert r.via == {"gen-b": "gen-a"}  # gen-c: written by the publisher itself
            holds(c, spec, 2)
            # version 2 went into the slot of version 1; gen-b's slot was not written
            assert c.call("staging")["slot_versions"][fenced] == -1
            # gen-b still frozen (left out at once): gen-c lends its slot of version 2 again
            r = publish(pub, tensors, 3, timeout=30.0)
            assert r.status == {"gen-a": "done", "gen-b": "excluded", "gen-c": "done"}, r.reasons
            assert r.via == {"gen-c": "gen-a"}
            assert c.call("staging")["slot_versions"][fenced] == -1
            # not applied yet: no slot to lend; excluded at the deadline, saying so
            r = publish(pub, tensors, 4, timeout=3.0)
            assert r.status["gen-c"] == "excluded", r.reasons
            assert "relay gen-b was cut off while writing" in r.reasons["gen-c"], r.reasons
            assert "not applied" in r.reasons["gen-c"], r.reasons
        holds(c, spec, 3)
        r = publish(pub, tensors, 5)
        assert r.done == ["gen-a", "gen-b", "gen-c"], r.reasons
    for s in (a, b, c):
        holds(s, spec, 5)
        assert s.call("violations") == []


def test_a_child_whose_record_is_missing_for_a_moment_is_relayed_again_at_the_next_version(
    trainer, spawn, tcp_store
):
    """The relay cannot reach a child whose record the store lacks for a moment (a store that
    restarted empty, before the child's next heartbeat puts it back): that costs the child the
    version in flight, not its membership; at the next version the relay plans it again."""
    a, b = start(spawn, ["gen-a", "gen-b"])
    key = "transport/default/peers/gen-b"
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors) as pub:
        # written directly first: gen-a has never connected to gen-b
        assert publish(pub, tensors, 1).done == ["gen-a", "gen-b"]
        b.call("hold_record")  # it goes on beating, but does not put its record back yet
        tcp_store.delete(key)
        pub.fanout = "chain"
        r = publish(pub, tensors, 2)
        assert r.via == {"gen-b": "gen-a"}
        assert r.status == {"gen-a": "done", "gen-b": "excluded"}, r.reasons
        assert "no record" in r.reasons["gen-b"], r.reasons
        b.call("release_record")
        wait_until(lambda: tcp_store.try_get(key) is not None, 30, "gen-b's record back")
        for v in (3, 4):
            r = publish(pub, tensors, v)
            assert r.done == ["gen-a", "gen-b"], r.reasons
            assert r.via == {"gen-b": "gen-a"}
    holds(a, SPEC, 4)
    holds(b, SPEC, 4)
    assert b.call("writers", "ver") == ["gen-a", "trainer"]
    for s in (a, b):
        assert s.call("violations") == []


def test_a_relay_that_leaves_hands_its_children_over(trainer, spawn):
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"])
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        assert publish(pub, tensors, 1).via == {"gen-b": "gen-a", "gen-c": "gen-b"}
        b.call("close")  # leaves the group; its Transport stays
        r = publish(pub, tensors, 2)
        assert r.status == {"gen-a": "done", "gen-c": "done"}, r.reasons
        assert r.via == {"gen-c": "gen-a"}
    holds(a, SPEC, 2)
    holds(c, SPEC, 2)
    assert b.call("live") == everywhere(SPEC, 0)  # never applied; nothing written after leaving
    assert b.call("staging")["slot_versions"] == [1, -1]


def test_relays_and_their_children_never_see_a_mixed_version(trainer, spawn):
    """The middle of a chain applies in a loop while it forwards (apply() and the forward read
    the same slot), and so does the end."""
    a, b, c = start(spawn, ["gen-a", "gen-b", "gen-c"])
    tensors = make_tensors(SPEC)
    last = 30
    with transport.WeightPublisher(trainer, tensors, fanout="chain") as pub:
        assert publish(pub, tensors, 1).done == ["gen-a", "gen-b", "gen-c"]
        for s in (b, c):
            s.call("snapshot_start", last, 120)
        statuses, vias = [], []
        for v in range(2, last + 1):
            r = publish(pub, tensors, v)
            statuses.append(r.status)
            vias.append(r.via)
            if v % 3 == 1:  # bursts of three versions, then each loop takes 100 more snapshots
                for s in (b, c):
                    s.call("wait_snapshots", 30 * v, 30)
        results = [s.call("snapshot_result", 150) for s in (b, c)]
    assert statuses == [{"gen-a": "done", "gen-b": "done", "gen-c": "done"}] * (last - 1)
    assert vias == [{"gen-b": "gen-a", "gen-c": "gen-b"}] * (last - 1)
    for s, out in zip((b, c), results, strict=True):
        assert not out["timed_out"], out
        assert out["mixed"] == 0, out["first_mixed"]
        assert out["backwards"] == 0
        assert out["final"] == last
        assert len(out["applied"]) >= 5, out["applied"]
        assert s.call("violations") == []
        assert s.call("live") == everywhere(SPEC, last)
    holds(a, SPEC, last)


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"fanout": "ring"}, "fanout must be one of"),
        ({"fanout": "tree", "degree": 0}, "degree"),
        ({"fanout": "tree", "degree": 17}, "degree"),
        ({"fanout": "tree", "degree": True}, "degree"),
    ],
)
def test_bad_fanout_is_refused_before_anything_is_exposed(trainer, kwargs, rule):
    tensors = make_tensors(SPEC)
    with pytest.raises(ValueError, match=rule):
        transport.WeightPublisher(trainer, tensors, **kwargs)
    assert trainer.regions() == {}
    pub = transport.WeightPublisher(trainer, tensors)
    with pytest.raises(ValueError, match="fanout must be one of"):
        pub.fanout = "star"
    assert pub.fanout == "direct"
    pub.close()
