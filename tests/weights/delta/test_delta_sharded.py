"""Delta versions from a sharded trainer, with real processes and NIXL: two trainer ranks
(ShardedPublisher(delta=True), each its own process) write the changes of their own parts into
generators of other layouts (vLLM's TP=2 pair with fused projections, bf16, fp8 with block
scales), in staging and in place; each generator compares every tensor with the reference made
from the full weights in its own process, which is what a whole version leaves there (the tests
of tests/weights/publishing/test_sharded_procs.py check that of whole versions)."""

from __future__ import annotations

import pytest

from helpers.shard_peer import GeneratorProcess, RankProcess, model_spec

pytestmark = [pytest.mark.delta, pytest.mark.timeout(600)]

SPEC = model_spec(hidden=1024, layers=1, vocab=1024)  # 51 MiB of float32
SPARSE = 0.02  # of every tensor's elements change per step; every fifth step all of them


def test_two_ranks_send_the_changes_of_their_parts_into_tp2_bf16_and_fp8_layouts(
    tcp_store, children
):
    ranks = [
        RankProcess(
            f"trainer-{r}", tcp_store.url, SPEC, 2, r, wait=False, delta=True, sparse=SPARSE
        )
        for r in range(2)
    ]
    kinds = [
        ("gen-tp0", "tp0of2", "staging"),
        ("gen-tp1", "tp1of2", "staging"),
        ("gen-tp0-inplace", "tp0of2", "inplace"),
        ("gen-bf16", "bf16", "staging"),
        ("gen-fp8", "fp8", "staging"),
    ]
    gens = [
        GeneratorProcess(n, tcp_store.url, SPEC, kind, mode, wait=False, delta=True, sparse=SPARSE)
        for n, kind, mode in kinds
    ]
    children += [*ranks, *gens]
    for c in children:
        c.started(180)
    names = sorted(c.name for c in gens)
    delta_names = {g.name for g in gens}
    patches = dict.fromkeys(delta_names, 0)
    for version in range(1, 6):
        for r in ranks:
            r.begin("publish", version, 60)  # every rank at once
        results = [r.end("publish", 120) for r in ranks]
        patched: set[str] = set()
        for res in results:
            assert res["done"] == names, res
            patched |= set(res["patched"])
            for name in res["patched"]:
                patches[name] += 1
        if version in (1, 5):  # no base yet; a dense step
            assert patched == set(), (version, patched)
        elif version == 2:  # in place holds the base; staging slots are copies from v3 on
            assert patched == {"gen-tp0-inplace"}, patched
        else:
            assert patched == delta_names, (version, patched)
        for g in gens:  # every byte as a whole version leaves it; a patch per rank with parts
            got = g.call("check", version, 60, timeout=120)
            assert got["version"] == version and got["bad"] == [], (g.name, version, got)
            assert got["deltas"] == (patches[g.name], 0), (g.name, version, got)


def test_delta_turned_on_and_off_between_versions_at_both_ranks(tcp_store, children):
    """``pub.delta`` set at both ranks between versions: turned on, the next version goes whole
    (each rank's copies start there) and the ones after as changes, in staging and in place;
    turned off, whole again. Every version lands as a whole version leaves it."""
    spec = model_spec(hidden=256, layers=1, vocab=256)
    ranks = [
        RankProcess(f"trainer-{r}", tcp_store.url, spec, 2, r, wait=False, sparse=SPARSE)
        for r in range(2)
    ]
    gens = [
        GeneratorProcess(n, tcp_store.url, spec, kind, mode, wait=False, delta=True, sparse=SPARSE)
        for n, kind, mode in (("gen-tp0", "tp0of2", "staging"), ("gen-tp1", "tp1of2", "inplace"))
    ]
    children += [*ranks, *gens]
    for c in children:
        c.started(180)
    names = sorted(g.name for g in gens)
    sent: dict[int, set[str]] = {}
    patches = dict.fromkeys(names, 0)
    for version in range(1, 6):
        if version in (2, 5):
            for r in ranks:
                assert r.call("set_delta", version == 2) is (version == 2)
        for r in ranks:
            r.begin("publish", version, 60)
        results = [r.end("publish", 120) for r in ranks]
        sent[version] = set()
        for res in results:
            assert res["done"] == names, res
            sent[version] |= set(res["patched"])
            for name in res["patched"]:
                patches[name] += 1
        for g in gens:  # every byte as a whole version leaves it; a patch per rank with parts
            got = g.call("check", version, 60, timeout=120)
            assert got["version"] == version and got["bad"] == [], (g.name, version, got)
            assert got["deltas"] == (patches[g.name], 0), (g.name, version, got)
    assert sent == {1: set(), 2: set(), 3: set(names), 4: set(names), 5: set()}, sent
