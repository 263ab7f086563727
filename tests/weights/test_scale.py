"""A mixture-of-experts-sized state dict: 20,000 tensors of four dtypes, each holding values of
its own (so a tensor landing in another's place shows), published to a staging subscriber and
an in-place one in child processes, every version checked tensor by tensor."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.ws_peer import SubscriberProcess, extremes
from transport.weights._flat import flat_like

N = 20_000
DTYPES = ("float32", "bfloat16", "int32", "float64")


def spec() -> dict[str, tuple[tuple[int, ...], str]]:
    # many small experts and a few large tensors
    out = {
        f"layers.{i // 64}.experts.{i % 64}.w": ((3, 5 + i % 7), DTYPES[i % 4]) for i in range(N)
    }
    out["embed"] = ((4096, 64), "float32")
    out["lm_head"] = ((64, 4096), "bfloat16")
    return out


def value(i: int, version: int) -> float:
    return float(i % 50 + 60 * version)  # exact in every dtype used, different per neighbour


def fill(tensors: dict[str, torch.Tensor], version: int) -> dict[str, tuple[float, float]]:
    for i, t in enumerate(tensors.values()):
        t.fill_(value(i, version))
    return extremes(tensors)


def test_flat_like_places_each_tensor_in_one_buffer_per_device():
    named = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (shape, dt) in spec().items()}
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


@pytest.mark.timeout(600)
def test_twenty_thousand_tensors_reach_staging_and_inplace_subscribers_whole(tcp_store):
    sp = spec()
    staging = SubscriberProcess("gen-staging", tcp_store.url, sp, wait=False, start_timeout=300)
    inplace = SubscriberProcess(
        "gen-inplace", tcp_store.url, sp, mode="inplace", wait=False, start_timeout=300
    )
    try:
        staging.started(300)
        inplace.started(300)
        # the trainer keeps its parameters in one flat buffer (as Megatron and FSDP2 do)
        zeros = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, (shape, dt) in sp.items()}
        tensors = flat_like(zeros)
        with (
            transport.Transport("trainer", store=tcp_store, timeout=120) as t,
            transport.WeightPublisher(t, tensors) as pub,
        ):
            for v in (1, 2, 3):
                want = fill(tensors, v)
                r = pub.publish(v, timeout=120).wait(180)
                assert r.status == {"gen-staging": "done", "gen-inplace": "done"}, r.reasons
                assert staging.call("wait_for_version", v, 60) == v
                assert staging.call("apply", timeout=120) == v
                assert staging.call("live", timeout=120) == want
                assert inplace.call("live", timeout=120) == want
        # two staging slots, each one flat buffer: two registrations for 20,002 tensors
        assert staging.call("registrations") == 2
    finally:
        staging.stop()
        inplace.stop()
