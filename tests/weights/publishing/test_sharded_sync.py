"""Sharded publishing on the loopback backend (fast; the real-process version is
tests/weights/publishing/test_sharded_procs.py): every rank of a trainer writes its own shards into each
subscriber's declared layout; the subscriber completes a version only when every rank's parts
landed, and the bytes equal a reference built from the full weights in one process."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.shard_peer import shard_of
from transport import LayoutError
from transport.weights import DestTensor, ShardedPublisher, SourceLayout, full_copy, tp_shard

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

H, FF = 64, 96
SHAPES = {
    "q": (H, H),
    "k": (H // 2, H),
    "v": (H // 2, H),
    "o": (H, H),
    "gate": (FF, H),
    "up": (FF, H),
    "down": (H, FF),
    "norm": (H,),
}
DIMS = {"o": 1, "down": 1, "norm": None}


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _tp(src: SourceLayout, degree: int, rank: int) -> dict[str, DestTensor]:
    return {
        "qkv_proj": tp_shard(src, "qkv_proj", ["q", "k", "v"], 0, degree, rank),
        "o_proj": tp_shard(src, "o_proj", ["o"], 1, degree, rank),
        "gate_up_proj": tp_shard(src, "gate_up_proj", ["gate", "up"], 0, degree, rank),
        "down_proj": tp_shard(src, "down_proj", ["down"], 1, degree, rank),
        "norm": full_copy(src, ["norm"])["norm"],
    }


def _tp_reference(full: dict[str, torch.Tensor], degree: int, rank: int) -> dict[str, torch.Tensor]:
    def part(name: str, dim: int) -> torch.Tensor:
        return full[name].chunk(degree, dim)[rank]

    return {
        "qkv_proj": torch.cat([part("q", 0), part("k", 0), part("v", 0)], 0),
        "o_proj": part("o", 1),
        "gate_up_proj": torch.cat([part("gate", 0), part("up", 0)], 0),
        "down_proj": part("down", 1),
        "norm": full["norm"],
    }


def _trainer(net, world, sizes=None):
    src = SourceLayout.split(world, {n: (s, torch.float32) for n, s in SHAPES.items()}, DIMS, sizes)
    full = _full(1)
    shards = [shard_of(src, full, r) for r in range(world)]
    pubs = [
        ShardedPublisher(net.make(f"trainer-{r}"), shards[r], src, r, group="policy")
        for r in range(world)
    ]
    return src, shards, pubs


def _whole(net, name):
    """A staging generator of whole tensors by name (no layout declared): (subscriber, live)."""
    live = {n: torch.zeros(s) for n, s in SHAPES.items()}
    return transport.WeightSubscriber(net.make(name), live, group="policy"), live


def _step(src, shards, step):
    full = _full(step)
    for r, mine in enumerate(shards):
        for n, t in shard_of(src, full, r).items():
            mine[n].copy_(t)
    return full


def _publish_all(pubs, version, timeout=20.0):
    handles = [p.publish(version, timeout=timeout) for p in pubs]
    return [h.wait(timeout + 10) for h in handles]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_writes_its_shards_into_full_tp_and_bf16_subscribers(loopback_net, world):
    sizes = {"q": [20, 30, 14], "gate": [96, 0, 0]} if world == 3 else None
    src, shards, pubs = _trainer(loopback_net, world, sizes)
    full_spec = {n: torch.zeros(s) for n, s in SHAPES.items()}
    whole = transport.WeightSubscriber(loopback_net.make("gen-full"), full_spec, group="policy")
    tps = []
    for r in range(2):
        lay = _tp(src, 2, r)
        live = {n: torch.zeros(d.shape) for n, d in lay.items()}
        tps.append(
            (
                transport.WeightSubscriber(
                    loopback_net.make(f"gen-tp{r}"),
                    live,
                    group="policy",
                    layout=lay,
                    mode="inplace",
                ),
                live,
            )
        )
    blay = {n: DestTensor(d.shape, torch.bfloat16, d.pieces) for n, d in full_copy(src).items()}
    bf16 = transport.WeightSubscriber(
        loopback_net.make("gen-bf16"),
        {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()},
        group="policy",
        layout=blay,
    )
    subs = sorted(s.transport.name for s in (whole, bf16, tps[0][0], tps[1][0]))
    for version in (1, 2, 3):
        full = _step(src, shards, version)
        for result in _publish_all(pubs, version):
            assert result.done == subs, result
        whole.wait_for_version(version, 10)
        assert whole.apply() == version
        for n in SHAPES:
            assert torch.equal(full_spec[n], full[n]), n
        for r, (sub, live) in enumerate(tps):
            assert sub.version == version
            ref = _tp_reference(full, 2, r)
            for n in ref:
                assert torch.equal(live[n], ref[n]), (r, n)
        with bf16.read(version, timeout=10) as snap:
            for n in SHAPES:
                assert torch.equal(snap.tensors[n], full[n].to(torch.bfloat16)), n
    for p in pubs:
        p.close()


def test_a_version_with_a_missing_rank_never_completes_and_names_it(loopback_net):
    src, shards, pubs = _trainer(loopback_net, 2)
    sub, live = _whole(loopback_net, "gen")
    full1 = _step(src, shards, 1)
    _publish_all(pubs, 1)
    sub.wait_for_version(1, 10)
    _step(src, shards, 2)
    result = pubs[0].publish(2, timeout=1.0).wait(20)  # rank 1 never publishes version 2
    assert result.excluded == [sub.transport.name]
    why = result.reasons[sub.transport.name]
    assert "rank 1 (" in why and "has not published version 2 (its newest: 1)" in why, why
    assert sub.version == 1 and sub.apply() == 1
    assert all(torch.equal(live[n], full1[n]) for n in SHAPES)
    full3 = _step(src, shards, 3)  # both ranks go on: the next version completes
    assert all(r.done == [sub.transport.name] for r in _publish_all(pubs, 3))
    sub.wait_for_version(3, 10)
    assert sub.apply() == 3 and all(torch.equal(live[n], full3[n]) for n in SHAPES)


def test_layouts_that_do_not_fit_are_refused_before_any_byte_moves(loopback_net):
    src, shards, pubs = _trainer(loopback_net, 2)
    bad = {
        "qkv_proj": DestTensor(
            (H, H), torch.float32, tp_shard(src, "x", ["q", "k"], 0, 2, 0).pieces
        ),
        "norm": DestTensor((H,), torch.int32, full_copy(src, ["norm"])["norm"].pieces),
    }
    live = {n: torch.zeros(d.shape, dtype=d.dtype) for n, d in bad.items()}
    sub = transport.WeightSubscriber(loopback_net.make("gen-bad"), live, group="policy", layout=bad)
    name = sub.transport.name
    for result in _publish_all(pubs, 1, timeout=5):
        why = result.reasons[name]
        assert result.excluded == [name] and "'qkv_proj'" in why and "'norm'" in why, why
    assert sub.version == -1 and all(not t.any() for t in live.values())
    with pytest.raises(LayoutError, match="'q'"):  # a shard of the wrong shape
        wrong = dict(shards[0], q=torch.zeros(3, H))
        ShardedPublisher(loopback_net.make("trainer-x"), wrong, src, 0, group="other")
    other = SourceLayout.split(2, {n: (s, torch.float32) for n, s in SHAPES.items()})  # all dim 0
    rank1 = ShardedPublisher(
        loopback_net.make("trainer-y"), shard_of(other, _full(1), 1), other, 1, group="g2"
    )
    rank0 = ShardedPublisher(loopback_net.make("trainer-z"), shards[0], src, 0, group="g2")
    with pytest.raises(LayoutError, match="rank 1 .* declares another source layout"):
        rank0.publish(1)
    for p in (*pubs, rank0, rank1):
        p.close()


def test_fp8_block_and_tensor_scales_equal_a_reference_quantization(loopback_net):
    from transport.weights import fp8
    from transport.weights.layouts.convert import fp8_blockwise, fp8_per_tensor

    src, shards, pubs = _trainer(loopback_net, 2)
    two_d = [n for n, s in SHAPES.items() if len(s) == 2]
    blocks = fp8(full_copy(src), two_d, block=(16, 16))
    lay_b = dict(blocks)
    live_b = transport.weights.tensors_for(lay_b)  # one flat buffer, zeroed
    assert all(
        t.dtype == lay_b[n].dtype and not t.view(torch.uint8).any() for n, t in live_b.items()
    )
    sub_b = transport.WeightSubscriber(
        loopback_net.make("gen-fp8"), live_b, group="policy", layout=lay_b
    )
    # per tensor: only where one rank writes the whole tensor (the replicated norm here)
    lay_t = fp8(full_copy(src, ["norm"]), ["norm"], block=None)
    live_t = {n: torch.zeros(d.shape, dtype=d.dtype) for n, d in lay_t.items()}
    sub_t = transport.WeightSubscriber(
        loopback_net.make("gen-fp8t"), live_t, group="policy", layout=lay_t
    )
    for version in (1, 2):
        full = _step(src, shards, version)
        for result in _publish_all(pubs, version):
            assert result.done == sorted([sub_b.transport.name, sub_t.transport.name]), result
        sub_b.wait_for_version(version, 10)
        sub_b.apply()
        for n in two_d:
            q, s = fp8_blockwise(full[n], (16, 16))
            assert torch.equal(live_b[n].view(torch.uint8), q.view(torch.uint8)), n
            assert torch.equal(live_b[n + "_scale"], s), n
        assert torch.equal(live_b["norm"], full["norm"])
        sub_t.wait_for_version(version, 10)
        sub_t.apply()
        q, s = fp8_per_tensor(full["norm"])
        assert torch.equal(live_t["norm"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(live_t["norm_scale"], s)
    # blocks that straddle two ranks' shards, and a per-tensor scale of a sharded tensor: refused
    with pytest.raises(LayoutError) as e:
        from transport.weights.layouts import check

        check(
            src,
            fp8(full_copy(src), ["gate", "q"], block=(32, 32))
            | fp8(full_copy(src, ["o"]), ["o"], block=None),
        )
    text = str(e.value)
    assert "rank 0's part of 'gate' spans 0..48 of dim 0, across fp8 blocks of 32" in text, text
    assert "'o': a per-tensor fp8 scale needs the whole tensor from one rank" in text, text
    assert "'q'" not in text  # 32-row shards of q hold whole 32-row blocks
    for p in pubs:
        p.close()


@pytest.mark.parametrize("pack", [True, False])
def test_fsdp_row_shards_into_column_shards_packed_or_row_by_row(loopback_net, pack):
    """Every matrix held along dim 0 (FSDP); the generators take TP column shards of o and down:
    each rank's part is strided in its shard and adjacent at the generator, packed through the
    pool (one write per chunk) or written one row at a time: the same bytes either way."""
    from transport.weights.layouts import plan
    from transport.weights.publishing.write_plan import Strided, strided_groups

    src = SourceLayout.split(2, {n: (s, torch.float32) for n, s in SHAPES.items()}, {"norm": None})
    full = _full(4)
    pubs = [
        ShardedPublisher(
            loopback_net.make(f"fsdp-{r}"),
            shard_of(src, full, r),
            src,
            r,
            group="fsdp",
            pack_strided=pack,
        )
        for r in range(2)
    ]
    subs = []
    for r in range(2):
        lay = _tp(src, 2, r)
        live = transport.weights.tensors_for(lay)
        subs.append(
            (
                transport.WeightSubscriber(
                    loopback_net.make(f"fsdp-gen{r}"),
                    live,
                    group="fsdp",
                    layout=lay,
                    mode="inplace",
                ),
                live,
            )
        )
    for result in _publish_all(pubs, 1):
        assert len(result.done) == 2, result
    for r, (sub, live) in enumerate(subs):
        assert sub.version == 1
        ref = _tp_reference(full, 2, r)
        assert all(torch.equal(live[n], ref[n]) for n in ref), r
    runs = plan(src, _tp(src, 2, 0), 0)
    groups = strided_groups(runs, {n: 4 for n in SHAPES})
    packed = [g for g in groups if isinstance(g, Strided)]
    assert {g.first.dest for g in packed} == {"o_proj", "down_proj"} and len(groups) < len(runs)
    for p in pubs:
        p.close()


def test_a_mixture_of_experts_of_20000_tensors_from_two_ranks(loopback_net):
    """20,000 expert matrices (dim-0 shards) and replicated norms: planned once per subscriber
    (the loopback checks each of the 20,000 descriptors by bisection), every byte of two
    versions checked."""
    shapes = {
        f"l{i // 1000}.e{i % 1000}.{w}": (32, 16) for i in range(10000) for w in ("up", "down")
    }
    shapes |= {f"l{i}.norm": (16,) for i in range(10)}
    src = SourceLayout.split(
        2,
        {n: (s, torch.float32) for n, s in shapes.items()},
        {n: None for n in shapes if n.endswith("norm")},
    )
    full = {n: torch.zeros(s) for n, s in shapes.items()}
    mine = [shard_of(src, full, r) for r in range(2)]  # each rank's shards, updated in place
    pubs = [
        ShardedPublisher(loopback_net.make(f"moe-{r}"), mine[r], src, r, group="moe")
        for r in range(2)
    ]
    lay = full_copy(src)
    live = transport.weights.tensors_for(lay)
    sub = transport.WeightSubscriber(loopback_net.make("moe-gen"), live, group="moe", layout=lay)
    for version in (1, 2):
        g = torch.Generator().manual_seed(version)
        want = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        for r in range(2):
            for n, t in shard_of(src, want, r).items():
                mine[r][n].copy_(t)
        for result in _publish_all(pubs, version, timeout=120):
            assert result.done == [sub.transport.name], result
        sub.wait_for_version(version, 60)
        assert sub.apply() == version
        bad = [n for n in shapes if not torch.equal(live[n], want[n])]
        assert bad == [], bad[:5]
    for p in pubs:
        p.close()


def test_a_subscriber_that_leaves_mid_version_is_settled_at_the_deadline(loopback_net):
    src, shards, pubs = _trainer(loopback_net, 2)
    sub, _ = _whole(loopback_net, "gen-leaves")
    first = pubs[0].publish(1, timeout=2.0)  # rank 1 never publishes: version 1 cannot complete
    sub.close()
    pubs[0].publish(2, timeout=2.0)  # reads the group: the subscriber left
    result = first.wait(30)  # settled, not waited on for ever
    assert result.excluded == [sub.transport.name], result
    for p in pubs:
        p.close()
