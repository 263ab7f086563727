"""Delta updates between a publisher (the test process) and subscriber processes, real NIXL agents:
every byte of every version compared with the trainer's (digests per tensor), versions sent as
their changes to the subscribers that hold their base and whole to the others, and the same
bytes either way.

The model is a small mixture of experts with tied embeddings, grouped-query attention with
biases, fused projections, float32 norms and an fp8 copy with scales (helpers/delta_peer.py);
each step changes a few percent of the elements, as a bfloat16 training step does."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import transport
from helpers import internals
from helpers.delta_peer import digests, model, model_spec, step

pytestmark = [pytest.mark.delta, pytest.mark.timeout(180)]

SPEC = model_spec()


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def publish(pub, tensors, version, want_done):
    r = pub.publish(version, timeout=30).wait(60)
    assert r.status == dict.fromkeys(want_done, "done"), r.reasons
    return r


def test_versions_travel_as_changes_and_land_bit_exact(trainer, start):
    """One subscriber takes changes, one takes every version whole: after each version both
    hold exactly the trainer's bytes, the live tensors change only at apply(), and the changes
    of a step that moved a few percent of the elements are a small part of the version."""
    changes = start("gen-delta", wait=False)
    whole = start("gen-whole", delta=False, wait=False)
    changes.started()
    whole.started()
    tensors = model(SPEC)
    full = nbytes(tensors)
    with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
        previous = None
        for version in range(1, 6):
            if version > 1:
                step(tensors, 0.02, seed=version)
            want = digests(tensors)
            r = publish(pub, tensors, version, ["gen-delta", "gen-whole"])
            if version == 1:
                assert r.patched == {}  # no base yet: whole
            else:
                assert set(r.patched) == {"gen-delta"}, r.patched
                assert r.patched["gen-delta"] < 0.1 * full, (r.patched, full)
            for child in (changes, whole):
                got = child.call("applied", version, 30)
                assert got["version"] == version
                assert got["live"] == want, child.name
                if previous is not None:
                    assert got["before"] == previous  # apply() is the only change of live
            previous = want
        assert changes.call("counts") == (4, 0)
        assert whole.call("counts") == (0, 0)


def test_a_dense_version_travels_whole_and_the_next_as_changes(trainer, start):
    """A version that changed more than half of its bytes goes whole to everyone; the next sparse
    one goes as changes again, onto the dense one."""
    sub = start("gen-delta")
    tensors = model(SPEC)
    with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
        publish(pub, tensors, 1, ["gen-delta"])
        step(tensors, 0.9, seed=2)
        r = publish(pub, tensors, 2, ["gen-delta"])
        assert r.patched == {}
        assert sub.call("applied", 2, 30)["live"] == digests(tensors)
        step(tensors, 0.01, seed=3)
        r = publish(pub, tensors, 3, ["gen-delta"])
        assert set(r.patched) == {"gen-delta"}
        assert sub.call("applied", 3, 30)["live"] == digests(tensors)


def test_a_subscriber_that_missed_a_version_or_joined_late_gets_the_next_whole(trainer, start):
    """A subscriber stopped during version 3 is excluded from it; version 4's changes apply to 3,
    which it lacks, so it gets 4 whole and then changes again. One that joins at version 4 gets
    it whole too. Every byte compared after each."""
    a = start("gen-a")
    tensors = model(SPEC)
    with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
        for v in (1, 2):
            if v > 1:
                step(tensors, 0.02, seed=v)
            publish(pub, tensors, v, ["gen-a"])
        os.kill(a.pid, signal.SIGSTOP)
        try:
            step(tensors, 0.02, seed=3)
            r = pub.publish(3, timeout=3).wait(30)
            assert r.status == {"gen-a": "excluded"}, r.reasons
        finally:
            os.kill(a.pid, signal.SIGCONT)
        late = start("gen-late")
        step(tensors, 0.02, seed=4)
        r = publish(pub, tensors, 4, ["gen-a", "gen-late"])
        assert r.patched == {}, r.patched  # neither holds version 3
        want = digests(tensors)
        assert a.call("applied", 4, 30)["live"] == want
        assert late.call("applied", 4, 30)["live"] == want
        step(tensors, 0.02, seed=5)
        r = publish(pub, tensors, 5, ["gen-a", "gen-late"])
        assert set(r.patched) == {"gen-a", "gen-late"}
        want = digests(tensors)
        assert a.call("applied", 5, 30)["live"] == want
        assert late.call("applied", 5, 30)["live"] == want


def test_a_restarted_subscriber_and_torn_live_tensors_get_the_next_version_whole(trainer, start):
    """A subscriber killed and started again (a new incarnation, nothing held) and one in place
    whose live tensors a whole version tore (stopped while it landed, excluded at the deadline)
    each get the next version whole, every byte right, and changes again after it."""
    a = start("gen-a", wait=False)
    b = start("gen-b", mode="inplace", wait=False)
    a.started()
    b.started()
    tensors = model(SPEC)
    names = ["gen-a", "gen-b"]
    with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
        for v in (1, 2):
            step(tensors, 0.02, seed=v)
            r = publish(pub, tensors, v, names)
            assert set(r.patched) == (set(names) if v == 2 else set()), r.patched
        os.kill(a.pid, signal.SIGKILL)
        a.stop()
        a = start("gen-a")  # the same name, a new incarnation
        os.kill(b.pid, signal.SIGSTOP)
        try:
            step(tensors, 0.9, seed=3)  # dense: whole, into b's live tensors while it is stopped
            r = pub.publish(3, timeout=3).wait(30)
            assert r.status == {"gen-a": "done", "gen-b": "excluded"}, r.reasons
        finally:
            os.kill(b.pid, signal.SIGCONT)
        for v in (4, 5):
            step(tensors, 0.02, seed=v)
            r = publish(pub, tensors, v, names)
            # 4: b lacks version 3 (torn), a holds it; 5: both hold 4
            assert set(r.patched) == ({"gen-a"} if v == 4 else set(names)), (v, r.patched)
            want = digests(tensors)
            assert a.call("applied", v, 30)["live"] == want
            assert b.call("applied", v, 30)["live"] == want


def test_auto_lands_every_version_bit_exact_whichever_way_it_goes(trainer, start):
    """``delta="auto"`` chooses by what versions cost here (on one host whole versions are
    cheap, so it may stop diffing and look again later); whichever way each version goes, every
    byte arrives, and the versions that went as changes are named in the result."""
    changes = start("gen-delta", wait=False)
    whole = start("gen-whole", delta=False, wait=False)
    changes.started()
    whole.started()
    tensors = model(SPEC)
    patched = 0
    with transport.WeightPublisher(trainer, tensors, delta="auto") as pub:
        for version in range(1, 13):
            if version > 1:
                step(tensors, 0.02, seed=version)
            r = publish(pub, tensors, version, ["gen-delta", "gen-whole"])
            assert set(r.patched) <= {"gen-delta"}
            patched += len(r.patched)
            want = digests(tensors)
            for child in (changes, whole):
                assert child.call("applied", version, 30)["live"] == want, (child.name, version)
    assert changes.call("counts") == (patched, 0)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        transport.WeightPublisher(trainer, tensors, group="other", delta="always")


def test_delta_turned_on_and_off_between_versions(trainer, start):
    """``pub.delta`` set between versions: turned on, the next version goes whole (the copy to
    diff against starts there) and the one after as changes; turned off while those changes are
    in flight, their version still ends done with them, and the next goes whole. Every version
    lands bit exact."""
    sub = start("gen-delta")
    tensors = model(SPEC)
    with transport.WeightPublisher(trainer, tensors, delta=False) as pub:
        sent = {}
        for version in range(1, 6):
            if version == 2:
                pub.delta = True
            if version > 1:
                step(tensors, 0.02, seed=version)
            handle = pub.publish(version, timeout=30)
            if version == 3:
                pub.delta = False  # its changes are on their way
                assert pub.delta is False
            r = handle.wait(60)
            assert r.status == {"gen-delta": "done"}, r.reasons
            sent[version] = set(r.patched)
            assert sub.call("applied", version, 30)["live"] == digests(tensors), version
        assert sent == {1: set(), 2: set(), 3: {"gen-delta"}, 4: set(), 5: set()}
        assert sub.call("counts") == (1, 0)


def test_changes_onto_a_base_the_subscriber_does_not_hold_are_refused_and_it_gets_whole(
    tcp_store, trainer
):
    """The subscriber's newest slot is made to say another version (as if it had lost it): the
    next changes name a base it does not hold, so it refuses them before writing a byte, and the
    publisher writes that version whole into the same slot, within the same publish."""
    tensors = model(SPEC)
    zeros = {n: torch.zeros_like(t) for n, t in tensors.items()}
    with transport.Transport("gen-local", store=tcp_store, timeout=30) as t:
        sub = transport.WeightSubscriber(t, zeros, delta=True)
        try:
            with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
                for v in (1, 2):
                    step(tensors, 0.02, seed=v)
                    publish(pub, tensors, v, ["gen-local"])
                internals.pretend_slot_holds(sub, 99)
                step(tensors, 0.02, seed=3)
                r = publish(pub, tensors, 3, ["gen-local"])
                assert r.patched == {}
            assert sub.wait_for_version(3, 10) == 3
            assert sub.apply() == 3
            assert digests(sub.live) == digests(tensors)
            assert (sub.deltas.patched, sub.deltas.refused) == (1, 1)
        finally:
            sub.close()


def test_one_staging_slot_takes_changes_once_applied_and_bad_sizes_are_refused(tcp_store, trainer):
    """With one staging slot, the slot still holds the version it applied: the next version's
    changes apply onto it, bit for bit."""
    tensors = model(SPEC)
    zeros = {n: torch.zeros_like(t) for n, t in tensors.items()}
    with transport.Transport("gen-one", store=tcp_store, timeout=30) as t:
        sub = transport.WeightSubscriber(t, zeros, delta=True, slots=1)
        try:
            with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
                for v in (1, 2, 3):
                    step(tensors, 0.02, seed=v)
                    r = publish(pub, tensors, v, ["gen-one"])
                    assert set(r.patched) == ({"gen-one"} if v > 1 else set()), r.patched
                    assert sub.wait_for_version(v, 10) == v
                    assert sub.apply() == v
                    assert digests(sub.live) == digests(tensors)
            assert (sub.deltas.patched, sub.deltas.refused) == (2, 0)
        finally:
            sub.close()
    with pytest.raises(TypeError, match="bool or a size"):
        transport.WeightSubscriber(trainer, tensors, delta="yes")
    with pytest.raises(ValueError, match="at least 64"):
        transport.WeightSubscriber(trainer, tensors, delta=8)


def test_changes_land_in_place_and_inside_a_window(trainer, start):
    """A subscriber in place applies the changes to its live tensors; a windowed one only inside
    receive(): its live tensors hold the version before until then, and are never torn."""
    inplace = start("gen-inplace", mode="inplace", wait=False)
    window = start("gen-window", mode="window", wait=False)
    inplace.started()
    window.started()
    tensors = model(SPEC)
    with transport.WeightPublisher(trainer, tensors, delta=True) as pub:
        previous = None
        for version in range(1, 5):
            if version > 1:
                step(tensors, 0.02, seed=version)
            want = digests(tensors)
            h = pub.publish(version, timeout=30)
            got = window.call("received", version, 30)
            r = h.wait(60)
            assert r.status == {"gen-inplace": "done", "gen-window": "done"}, r.reasons
            if version > 1:
                assert set(r.patched) == {"gen-inplace", "gen-window"}, r.patched
                assert got["before"] == previous  # nothing was written outside the window
            assert got["live"] == want and got["torn"] is None
            assert inplace.call("applied", version, 30)["live"] == want
            previous = want
    assert inplace.call("counts") == (3, 0)
    assert window.call("counts") == (3, 0)


@pytest.mark.parametrize("fanout", ["chain", "tree"])
def test_relays_forward_the_changes_they_took_to_children_holding_the_base(trainer, start, fanout):
    """Relayed fan-out: the publisher writes the changes once (to the first relay), and each
    relay forwards the same changes to children holding their base; every subscriber holds the
    trainer's bytes after each version, the one that takes versions whole too (written whole
    by its relay). The result's ``patched`` names each one that took the changes, whoever
    wrote them, with the same bytes (one blob, forwarded as it came), and not the one written
    whole."""
    names = ["gen-a", "gen-b", "gen-c", "gen-whole"]
    children = [start(n, wait=False, delta=n != "gen-whole") for n in names]
    for c in children:
        c.started()
    tensors = model(SPEC)
    full = nbytes(tensors)
    with transport.WeightPublisher(trainer, tensors, delta=True, fanout=fanout) as pub:
        for version in range(1, 5):
            if version > 1:
                step(tensors, 0.02, seed=version)
            want = digests(tensors)
            r = publish(pub, tensors, version, names)
            assert len(r.via) >= 2, r.via  # relays wrote most of them
            if version > 1:  # the trainer wrote changes only, the relays changes to the others
                assert set(r.patched) == set(names) - {"gen-whole"}, (r.patched, r.via)
                assert len(set(r.patched.values())) == 1, r.patched
                assert all(n < 0.1 * full for n in r.patched.values()), r.patched
            for c in children:
                assert c.call("applied", version, 30)["live"] == want, (c.name, version)
    counts = {c.name: c.call("counts") for c in children}
    # from version 2 on each delta subscriber took changes: from the trainer or a relay
    assert counts == {"gen-a": (3, 0), "gen-b": (3, 0), "gen-c": (3, 0), "gen-whole": (0, 0)}
