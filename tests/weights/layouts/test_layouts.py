"""Layouts as data (transport.weights.layouts): the runs each trainer rank computes from the
source and destination layouts, applied to that rank's own shards, rebuild every destination
tensor exactly as a reference built from the full weights in one process (torch's chunk and
cat), and every destination byte is written by exactly one rank. Refusals name every problem."""

from __future__ import annotations

import pytest
import torch

from transport import LayoutError
from transport.weights import DestTensor, Piece, Slice, SourceLayout, full_copy, tp_shard
from transport.weights.layouts import apply_runs, check, plan

pytestmark = pytest.mark.unit

H, FF, V = 64, 96, 80  # hidden, intermediate, vocabulary: small, and uneven over 3 ranks


def _model(g: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    shapes = {
        "embed": (V, H),
        "q": (H, H),
        "k": (H // 2, H),
        "v": (H // 2, H),
        "o": (H, H),
        "gate": (FF, H),
        "up": (FF, H),
        "down": (H, FF),
        "norm": (H,),
        "head": (V, H),
    }
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


# most tensors split along dim 0, the row-parallel ones along dim 1, norms replicated
DIMS = {"o": 1, "down": 1, "norm": None}


def _source(full, world, sizes=None):
    return SourceLayout.split(world, {n: (t.shape, t.dtype) for n, t in full.items()}, DIMS, sizes)


def _locals(src: SourceLayout, full, rank):
    out = {}
    for n, t in full.items():
        box = src.tensors[n].held[rank].box(t.shape)
        out[n] = t[tuple(slice(lo, hi) for lo, hi in box)].contiguous()
    return out


def _deliver(src, full, dest):
    """Every rank's runs applied to its own shards; returns the tensors and a write count per byte."""
    out = {n: torch.zeros(d.shape, dtype=d.dtype) for n, d in dest.items()}
    counts = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in out.items()}
    for rank in range(src.world):
        runs = plan(src, dest, rank)
        apply_runs(runs, _locals(src, full, rank), out)
        for r in runs:
            counts[r.dest][r.dst_at : r.dst_at + r.count] += 1
    for n, c in counts.items():
        assert bool((c == 1).all()), f"{n}: elements written {c.min()}..{c.max()} times"
    return out


def _vllm_tp(src, degree, rank):
    """vLLM's layout of one TP rank: fused qkv and gate_up, column and row shards, full norm."""
    return {
        "qkv_proj": tp_shard(src, "qkv_proj", ["q", "k", "v"], 0, degree, rank),
        "gate_up_proj": tp_shard(src, "gate_up_proj", ["gate", "up"], 0, degree, rank),
        "o_proj": tp_shard(src, "o_proj", ["o"], 1, degree, rank),
        "down_proj": tp_shard(src, "down_proj", ["down"], 1, degree, rank),
        "embed": tp_shard(src, "embed", ["embed"], 0, degree, rank),
        "lm_head": tp_shard(src, "lm_head", ["head"], 0, degree, rank),
        "norm": full_copy(src, ["norm"])["norm"],
    }


def _vllm_reference(full, degree, rank):
    def chunk(n, dim):
        return full[n].chunk(degree, dim)[rank]

    return {
        "qkv_proj": torch.cat([chunk("q", 0), chunk("k", 0), chunk("v", 0)], 0),
        "gate_up_proj": torch.cat([chunk("gate", 0), chunk("up", 0)], 0),
        "o_proj": chunk("o", 1),
        "down_proj": chunk("down", 1),
        "embed": chunk("embed", 0),
        "lm_head": chunk("head", 0),
        "norm": full["norm"],
    }


@pytest.mark.parametrize("world", [1, 2, 3])
def test_full_tensors_from_sharded_ranks(world):
    full = _model(torch.Generator().manual_seed(world))
    src = _source(full, world)
    got = _deliver(src, full, full_copy(src, rename={"lm_head": "head"}))
    for n, t in full.items():
        assert torch.equal(got[n], t), n
    assert torch.equal(got["lm_head"], full["head"])


@pytest.mark.parametrize("world,sizes", [(2, None), (3, {"q": [10, 40, 14], "gate": [0, 50, 46]})])
def test_two_tp_ranks_with_fused_parameters(world, sizes):
    full = _model(torch.Generator().manual_seed(7))
    src = _source(full, world, sizes)
    for tp_rank in range(2):
        got = _deliver(src, full, _vllm_tp(src, 2, tp_rank))
        for n, t in _vllm_reference(full, 2, tp_rank).items():
            assert torch.equal(got[n], t), (tp_rank, n)


def test_a_replicated_source_is_written_once_and_the_work_is_spread():
    full = {f"norm{i}": torch.randn(H) for i in range(6)}
    src = SourceLayout.split(
        2, {n: (t.shape, t.dtype) for n, t in full.items()}, dict.fromkeys(full)
    )
    dest = full_copy(src)
    got = _deliver(src, full, dest)  # each byte exactly once (checked there)
    assert all(torch.equal(got[n], full[n]) for n in full)
    assert [len(plan(src, dest, r)) for r in range(2)] == [3, 3]


def test_a_dim0_shard_into_a_dim0_destination_is_one_run_per_rank():
    full = {"w": torch.randn(64, 32)}
    src = SourceLayout.split(2, {"w": (full["w"].shape, full["w"].dtype)})
    runs = plan(src, full_copy(src), 0)
    assert len(runs) == 1 and runs[0].count == 32 * 32


def test_layouts_that_do_not_fit_are_refused_with_every_problem_named():
    f32 = torch.float32
    src = SourceLayout(
        2,
        {
            "gap": _t((8, 4), f32, {0: Slice(0, 0, 3), 1: Slice(0, 4, 8)}),
            "overlap": _t((8, 4), f32, {0: Slice(0, 0, 5), 1: Slice(0, 4, 8)}),
            "w": _t((8, 4), f32, {0: Slice(0, 0, 4), 1: Slice(0, 4, 8)}),
        },
    )
    dest = {
        "short": DestTensor((6, 4), f32, (Piece("w", Slice(0, 0, 4)),)),
        "wrong_shape": DestTensor((8, 5), f32, (Piece("w"),)),
        "wrong_dtype": DestTensor((8, 4), torch.int32, (Piece("w"),)),  # floats convert, ints not
        "missing": DestTensor((8, 4), f32, (Piece("nothing"),)),
        "overlapping": DestTensor(
            (8, 4), f32, (Piece("w", Slice(0, 0, 8)), Piece("w", Slice(0, 0, 4), at=4))
        ),
    }
    with pytest.raises(LayoutError) as e:
        check(src, dest)
    text = "\n".join(e.value.problems)
    for name in ("gap", "overlap", "short", "wrong_shape", "wrong_dtype", "missing", "overlapping"):
        assert repr(name) in text, (name, text)
    assert len(e.value.problems) == 7, e.value.problems
    with pytest.raises(LayoutError):  # plan() checks first: nothing is planned from a bad pair
        plan(src, dest, 0)


def _t(shape, dtype, held):
    from transport.weights.layouts import SourceTensor

    return SourceTensor(shape, dtype, held)


def test_a_destination_of_another_float_dtype_gets_the_converted_values():
    g = torch.Generator().manual_seed(3)
    full = _model(g)
    src = _source(full, 2)
    dest = {
        n: DestTensor(d.shape, torch.bfloat16, d.pieces, d.dim) for n, d in full_copy(src).items()
    }
    got = _deliver(src, full, dest)
    assert all(torch.equal(got[n], full[n].to(torch.bfloat16)) for n in full)


def test_dtensor_placements_give_the_layout_torch_chunk_gives():
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(5)
    full = _model(g)
    place = {n: Replicate() if DIMS.get(n, 0) is None else Shard(DIMS.get(n, 0)) for n in full}
    place["down"] = Shard(-1)  # negative dims count from the end, as DTensor's do
    src = SourceLayout.from_placements(3, {n: (t.shape, t.dtype) for n, t in full.items()}, place)
    assert src == _source(full, 3)
    with pytest.raises(LayoutError, match="'q': placement 'partial'"):
        SourceLayout.from_placements(2, {"q": ((4, 4), torch.float32)}, {"q": "partial"})


def test_dtensors_on_a_mesh_give_the_layout_rank_and_shards():
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w, n = torch.randn(6, 4), torch.randn(4)
        named = {
            "w": distribute_tensor(w, mesh, [Shard(1)]),
            "n": distribute_tensor(n, mesh, [Replicate()]),
        }
        layout, rank, shards = SourceLayout.from_dtensors(named)
        assert rank == 0 and layout.world == 1
        assert layout.tensors["w"].held[0] == Slice(1, 0, 4) and layout.tensors["n"].replicated
        assert torch.equal(shards["w"], w) and torch.equal(shards["n"], n)
    finally:
        dist.destroy_process_group()
