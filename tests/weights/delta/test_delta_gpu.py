"""Delta updates on the GPU: the codec's kernels (torch ops on the device) and the two publishers'
delta paths with CUDA tensors, real NIXL between separate Transports. The model is the delta
tests' (helpers/delta_peer.py: tied embeddings, grouped-query attention with biases, fused
projections, experts fused, float32 norms, an fp8 copy with its scales). Every byte that arrived is
compared with the trainer's; the publish results and the subscribers' counts show that the
versions after the first went as changes, not whole.

Each test runs on ``cpu`` too (small and quick), so the same claims hold where there is no GPU and
a GPU-only difference shows up as the ``cuda`` case failing alone."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.delta_peer import digests, model, model_spec, step
from helpers.shard_peer import shard_of
from transport.weights import DestTensor, ShardedPublisher, SourceLayout, full_copy, tensors_for
from transport.weights.delta.codec import DeltaLayout, encode
from transport.weights.delta.decoder import apply, decode

NO_CUDA = not torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(NO_CUDA, reason="this process has no CUDA device")
    ),
]
pytestmark = [pytest.mark.cuda, pytest.mark.delta, pytest.mark.timeout(180)]


SPEC = model_spec(layers=1)


def on(device: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(device) for n, t in tensors.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("share", [0.0005, 0.02, 0.3, 1.0])
def test_the_codec_on_the_device_makes_the_cpu_blob_and_applies_either_way(device, share):
    """Changes encoded on the device are byte for byte the blob the CPU makes of the same
    tensors; applied on the device or on the CPU (a GPU trainer, a CPU generator) they give the
    version bit for bit; and the encoder's copy becomes the version."""
    base = model(SPEC)
    cur = on("cpu", base)
    step(cur, share, seed=1)
    want_bytes = digests(cur)
    layout = DeltaLayout(cur)
    want = encode(layout, cur, on("cpu", base), 2, 1)
    dev_copy = on(device, base)
    got = encode(layout, on(device, cur), dev_copy, 2, 1)
    assert want is not None and got is not None
    assert got.blob.device.type == torch.device(device).type
    assert torch.equal(got.blob.cpu(), want.blob), "the device's blob differs from the CPU's"
    assert got.changed == want.changed
    assert digests(dev_copy) == want_bytes
    on_device = on(device, base)
    apply(decode(layout, got.blob, 2, 1), on_device)
    assert digests(on_device) == want_bytes
    on_cpu = on("cpu", base)
    apply(decode(layout, got.blob.cpu(), 2, 1), on_cpu)
    assert digests(on_cpu) == want_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_a_publisher_of_device_tensors_sends_changes_into_device_subscribers(tcp_store, device):
    """A WeightPublisher(delta=True) of device tensors, one subscriber in staging and one in
    place, both into device tensors: five versions, the four after the first as changes, every
    byte equal to the trainer's after each apply()."""
    opened = []
    try:
        trainer = transport.Transport("gpu-delta-trainer", store=tcp_store, timeout=30)
        opened.append(trainer)
        subs = {}
        for mode in ("staging", "inplace"):
            t = transport.Transport(f"gpu-delta-{mode}", store=tcp_store, timeout=30)
            opened.append(t)
            live = {n: torch.zeros_like(v) for n, v in on(device, model(SPEC)).items()}
            subs[t.name] = (
                transport.WeightSubscriber(t, live, group="d", delta=True, mode=mode),
                live,
            )
        tensors = on(device, model(SPEC))
        with transport.WeightPublisher(trainer, tensors, group="d", delta=True) as pub:
            for version in range(1, 6):
                if version > 1:
                    step(tensors, 0.02, seed=version)
                r = pub.publish(version, timeout=30).wait(60)
                assert r.status == dict.fromkeys(subs, "done"), r.reasons
                if version > 1:
                    assert set(r.patched) == set(subs), (version, r.patched)
                for name, (sub, live) in subs.items():
                    sub.wait_for_version(version, 30)
                    sub.apply()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    assert digests(live) == digests(tensors), (name, version)
            for name, (sub, _) in subs.items():
                assert (sub.deltas.patched, sub.deltas.refused) == (4, 0), name
                sub.close()
    finally:
        for t in opened:
            t.close()


@pytest.mark.parametrize("device", DEVICES)
def test_two_device_ranks_send_the_changes_of_their_parts_into_a_bf16_generator(tcp_store, device):
    """Two ShardedPublisher(delta=True) ranks with device shards (float32, split by rows and by
    columns) into a bf16 device generator in staging: converted on the device, the changes of
    each rank's parts land in its share of the inbox; every byte equals the full weights cast."""
    shapes = {"q": (512, 256), "o": (256, 512), "n": (256,)}
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()}
    src = SourceLayout.split(
        2, {n: (s, torch.float32) for n, s in shapes.items()}, {"o": 1, "n": None}
    )
    bf16 = {n: DestTensor(d.shape, torch.bfloat16, d.pieces) for n, d in full_copy(src).items()}
    opened = []
    try:
        ranks, shards = [], []
        for r in range(2):
            t = transport.Transport(f"gpu-delta-rank{r}", store=tcp_store, timeout=30)
            opened.append(t)
            shards.append(shard_of(src, full, r))
            ranks.append(ShardedPublisher(t, shards[r], src, r, group="s", delta=True))
        t = transport.Transport("gpu-delta-bf16", store=tcp_store, timeout=30)
        opened.append(t)
        live = tensors_for(bf16, device)
        sub = transport.WeightSubscriber(t, live, group="s", layout=bf16, delta=True)
        patches = 0
        for version in range(1, 5):
            if version > 1:
                step(full, 0.02, seed=version)
                for r in range(2):  # the ranks publish the tensors they were given
                    for n, s in shard_of(src, full, r).items():
                        shards[r][n].copy_(s)
            handles = [p.publish(version, timeout=30) for p in ranks]
            results = [h.wait(60) for h in handles]
            for res in results:
                assert res.status == {"gpu-delta-bf16": "done"}, res.reasons
                patches += "gpu-delta-bf16" in res.patched
            sub.wait_for_version(version, 30)
            sub.apply()
            if device == "cuda":
                torch.cuda.synchronize()
            cast = {n: full[n].to(torch.bfloat16) for n in shapes}
            assert digests(live) == digests(cast), version
        assert patches >= 2 and (sub.deltas.patched, sub.deltas.refused) == (patches, 0)
        for p in ranks:
            p.close()
        sub.close()
    finally:
        for t in opened:
            t.close()
