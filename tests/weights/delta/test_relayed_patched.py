"""The publisher's result names every subscriber that took a version as its changes, whoever
wrote them: a relay that forwards the changes it took reports their bytes, and the result's
``patched`` holds them for its children (the same blob the trainer wrote, byte for byte), while
a child written whole is absent. Real NIXL agents in child processes; every byte of every
subscriber compared with the trainer's (digests per tensor)."""

from __future__ import annotations

import pytest

import transport
from helpers.delta_peer import digests, model, model_spec, step
from transport.weights.delta.codec import DeltaLayout, encode

pytestmark = [pytest.mark.delta, pytest.mark.timeout(180)]

SPEC = model_spec()


def changes_bytes(tensors, base, version) -> int:
    """The bytes of the blob that makes ``version`` (``tensors``) out of ``base``, as the
    publisher encodes it (its copy: every tensor, by sorted name)."""
    names = sorted(tensors)
    layout = DeltaLayout({n: tensors[n] for n in names})
    enc = encode(layout, tensors, {n: base[n].clone() for n in names}, version, version - 1)
    assert enc is not None
    return int(enc.blob.numel())


def test_a_relays_children_that_took_its_changes_are_in_patched_with_their_bytes(trainer, start):
    """The trainer writes version 2's changes to relay gen-a only; gen-a forwards the same
    changes to gen-b and gen-c, which hold version 1, and writes gen-late (joined after version
    1: it holds no base) whole. ``patched`` holds the blob's bytes for gen-a, gen-b and gen-c,
    not gen-late; at version 3 gen-late holds the base and takes the changes too."""
    subs = {n: start(n, wait=False) for n in ("gen-a", "gen-b", "gen-c")}
    for c in subs.values():
        c.started()
    tensors = model(SPEC)
    with transport.WeightPublisher(trainer, tensors, delta=True, fanout="tree", degree=3) as pub:
        r = pub.publish(1, timeout=30).wait(60)
        assert r.status == dict.fromkeys(subs, "done"), r.reasons
        assert r.via == {"gen-b": "gen-a", "gen-c": "gen-a"}
        assert r.patched == {}  # no base yet: whole
        for c in subs.values():
            assert c.call("applied", 1, 30)["live"] == digests(tensors), c.name
        subs["gen-late"] = start("gen-late")

        for version, took_changes in ((2, ["gen-a", "gen-b", "gen-c"]), (3, sorted(subs))):
            base = {n: t.clone() for n, t in tensors.items()}
            step(tensors, 0.02, seed=version)
            want, nbytes = digests(tensors), changes_bytes(tensors, base, version)
            r = pub.publish(version, timeout=30).wait(60)
            assert r.status == dict.fromkeys(subs, "done"), r.reasons
            # the trainer wrote only the relay; the relay wrote every other one
            assert r.via == dict.fromkeys(["gen-b", "gen-c", "gen-late"], "gen-a")
            assert r.patched == dict.fromkeys(took_changes, nbytes), (version, r.patched)
            assert nbytes < 0.1 * sum(t.nbytes for t in tensors.values())
            for c in subs.values():
                got = c.call("applied", version, 30)
                assert got["version"] == version
                assert got["live"] == want, (c.name, version)
        # what each one applied agrees with the result: gen-late took version 2 whole
        counts = {n: c.call("counts") for n, c in subs.items()}
        assert counts == {"gen-a": (2, 0), "gen-b": (2, 0), "gen-c": (2, 0), "gen-late": (1, 0)}
