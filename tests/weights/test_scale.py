"""Mixture-of-experts-sized state dicts: 100,000 tensors of four dtypes (many small experts, a few
large tensors), each holding values of its own (so a tensor landing in another's place shows),
published to staging, in-place and subset subscribers in child processes, every version checked
tensor by tensor; and the registrations and records they cost on each side."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.ws_peer import SubscriberProcess, extremes
from transport.weights import flat_like
from transport.wire import MAX_RECORD_BYTES

DTYPES = ("float32", "bfloat16", "int32", "float64")
Spec = dict[str, tuple[tuple[int, ...], str]]


def spec(n: int) -> Spec:
    """``n`` expert tensors (128 experts of 3 projections per layer) and two large ones."""
    out: Spec = {
        f"model.layers.{i // 384}.mlp.experts.{i // 3 % 128}.{('gate', 'up', 'down')[i % 3]}": (
            (3, 5 + i % 7),
            DTYPES[i % 4],
        )
        for i in range(n)
    }
    out["model.embed_tokens.weight"] = ((4096, 1024), "float32")
    out["lm_head.weight"] = ((1024, 4096), "bfloat16")
    return out


def value(i: int, version: int) -> float:
    return float(i % 50 + 60 * version)  # exact in every dtype used, different per neighbour


def fill(tensors: dict[str, torch.Tensor], version: int) -> dict[str, tuple[float, float]]:
    for i, t in enumerate(tensors.values()):
        t.fill_(value(i, version))
    return extremes(tensors)


def zeros(sp: Spec) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (shape, dt) in sp.items()}


def record_bytes(store: transport.store.Store, name: str) -> int:
    raw = store.try_get(f"transport/default/peers/{name}")
    assert raw is not None
    return len(raw)


def test_flat_like_places_each_tensor_in_one_buffer_per_device():
    named = zeros(spec(20_000))
    flat = flat_like(named)
    assert list(flat) == list(named)
    storages = {t.untyped_storage().data_ptr() for t in flat.values()}
    assert len(storages) == 1
    ends = []
    for n, t in flat.items():
        assert t.shape == named[n].shape and t.dtype == named[n].dtype and t.is_contiguous()
        assert t.data_ptr() % t.element_size() == 0
        ends.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # in order, apart


@pytest.mark.timeout(900)
def test_a_hundred_thousand_tensors_reach_staging_inplace_and_subset_subscribers_whole(tcp_store):
    """The trainer's 100,002 parameters are separately allocated (the hard case: a descriptor
    and a registration per tensor, unless packed); a staging subscriber, one in place, one taking
    10,000 names."""
    sp = spec(100_000)
    names = list(sp)
    subset = {n: sp[n] for n in names[::10]}
    assert len(subset) == 10_001
    kinds = {"gen-s0": (sp, "staging"), "gen-in": (sp, "inplace"), "gen-few": (subset, "staging")}
    subs = {
        name: SubscriberProcess(name, tcp_store.url, s, mode=mode, wait=False, start_timeout=600)
        for name, (s, mode) in kinds.items()
    }
    try:
        for child in subs.values():
            child.started(600)
        tensors = zeros(sp)
        with (
            transport.Transport("trainer", store=tcp_store, timeout=300) as t,
            transport.WeightPublisher(t, tensors) as pub,
        ):
            for v in (1, 2, 3):
                want = fill(tensors, v)
                r = pub.publish(v, timeout=300).wait(400)
                assert r.status == dict.fromkeys(kinds, "done"), r.reasons
                for name, child in subs.items():
                    if kinds[name][1] == "staging":
                        assert child.call("wait_for_version", v, 120) == v
                        assert child.call("apply", timeout=300) == v
                    got = child.call("live", timeout=300)
                    assert got == {n: want[n] for n in kinds[name][0]}, name
            # each of its 100,002 tensors is a storage of its own; the 100,000 small ones are
            # copied into one buffer at every publish (weights/publishing/pack.py), so it registers that
            # buffer, the two large tensors and the version word, and its record (which
            # describes only what it exposes) stays far inside what a store takes
            assert len(internals.local_memory(t)) == 4
            assert record_bytes(tcp_store, "trainer") < MAX_RECORD_BYTES // 2
        # two staging slots, each one flat buffer: two registrations for 100,002 tensors, and a
        # record of 200,004 regions
        assert subs["gen-s0"].call("registrations") == 2
        assert record_bytes(tcp_store, "gen-s0") < MAX_RECORD_BYTES // 2
    finally:
        for child in subs.values():
            child.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["flat", "separate"])
def test_a_trainer_of_either_layout_publishes_and_a_flat_one_registers_one_span(tcp_store, layout):
    sp = spec(5_000)
    sub = SubscriberProcess("gen-0", tcp_store.url, sp, start_timeout=300)
    try:
        tensors = flat_like(zeros(sp)) if layout == "flat" else zeros(sp)
        with (
            transport.Transport("trainer", store=tcp_store, timeout=120) as t,
            transport.WeightPublisher(t, tensors) as pub,
        ):
            for v in (1, 2):
                want = fill(tensors, v)
                r = pub.publish(v, timeout=120).wait(180)
                assert r.status == {"gen-0": "done"}, r.reasons
                assert sub.call("wait_for_version", v, 60) == v
                assert sub.call("apply", timeout=120) == v
                assert sub.call("live", timeout=120) == want
            spans = len(internals.local_memory(t)) - 1  # less the version word's
            # separate: the 5,000 small tensors through the publisher's pack, the 2 large ones
            assert spans == (1 if layout == "flat" else 3)
    finally:
        sub.stop()
