"""From a replay's maps to a worker's layout (transport/integrations/vllm/shards.py), without
vLLM: each map is what a loader would leave in a float64 stand-in of a parameter (checkpoint
element numbers, -1 where it wrote nothing, 0 for padding). Slices of the checkpoint become
pieces, checked element for element; anything else falls back, named, with every tensor that
shares a parameter with it."""

from __future__ import annotations

import pytest
import torch

from transport.integrations.vllm.shards import _layout, _Numbering, _Params, fall_back, whole
from transport.weights import Slice, SourceLayout
from transport.weights.layouts import apply_runs, plan

pytestmark = pytest.mark.unit

H = 8
SPEC = {
    "q": torch.empty(H, H, device="meta"),
    "k": torch.empty(H // 2, H, device="meta"),
    "v": torch.empty(H // 2, H, device="meta"),
    "o": torch.empty(H, H, device="meta"),
    "embed": torch.empty(6, H, device="meta"),
    "unused": torch.empty(3, device="meta"),
}


def _offsets() -> dict[str, int]:
    out, at = {}, 1
    for n, t in SPEC.items():
        out[n], at = at, at + t.numel()
    return out


def _numbers(name: str) -> torch.Tensor:
    t = SPEC[name]
    return torch.arange(t.numel(), dtype=torch.float64).view(t.shape) + _offsets()[name]


def _params(maps: dict[str, torch.Tensor]) -> _Params:
    return _Params(
        holders={k: [] for k in maps},
        names={k: [k] for k in maps},
        template={k: torch.empty(m.shape, device="meta") for k, m in maps.items()},
    )


def _layout_of(maps: dict[str, torch.Tensor], raised: dict[str, str] | None = None):
    return _layout(SPEC, _offsets(), _params(maps), maps, raised or {})


def test_tp_rank_1_of_2_fused_row_parallel_and_padded_maps_become_checked_pieces():
    half = H // 2
    maps = {
        # rank 1's q rows, k rows 2..4, v rows 2..4, stacked (vLLM's qkv_proj)
        "qkv": torch.cat([_numbers("q")[half:], _numbers("k")[2:], _numbers("v")[2:]]),
        "o_part": _numbers("o")[:, half:].contiguous(),  # row parallel: columns
        # vocabulary parallel, padded to 4 rows: 3 rows of the checkpoint, then a zero row
        "embed_part": torch.cat([_numbers("embed")[3:], torch.zeros(1, H, dtype=torch.float64)]),
    }
    layout = _layout_of(maps)
    assert layout.fallback == {
        "unused": "vLLM's loader put none of it into a parameter of this worker"
    }
    qkv = layout.dest["qkv"]
    assert [(p.source, p.take, p.at) for p in qkv.pieces] == [
        ("q", Slice(0, half, H), 0),
        ("k", Slice(0, 2, 4), half),
        ("v", Slice(0, 2, 4), half + 2),
    ]
    assert layout.dest["o_part"].dim == 1
    assert layout.targets["embed_part"].rows == 3 and layout.dest["embed_part"].shape == (3, H)
    # the layout moves exactly what the loader put there
    source = SourceLayout.split(
        1, {n: (tuple(t.shape), torch.float64) for n, t in SPEC.items()}, dict.fromkeys(SPEC)
    )
    local = {n: _numbers(n) for n in SPEC}
    got = {n: torch.full(d.shape, -1.0, dtype=torch.float64) for n, d in layout.dest.items()}
    dest = {n: d for n, d in layout.dest.items() if n in layout.targets}
    dest = {n: type(d)(d.shape, torch.float64, d.pieces, d.dim) for n, d in dest.items()}
    apply_runs(plan(source, dest, 0), local, got)
    for name in dest:
        rows = layout.targets[name].rows
        assert torch.equal(got[name], maps[name][:rows]), name


def test_maps_no_slices_make_fall_back_named_with_every_tensor_sharing_a_parameter():
    maps = {
        "qk": torch.cat([_numbers("q"), _numbers("k")]),  # fine alone ...
        "kv_t": torch.cat([_numbers("k"), _numbers("v")]).t().contiguous(),  # transposed
        "o_scaled": _numbers("o") + 0.5,  # values the loader computed
        "embed_part": torch.cat(
            [
                _numbers("embed")[:2],
                torch.full((1, H), -1.0, dtype=torch.float64),
                _numbers("embed")[2:3],
            ]
        ),
    }
    layout = _layout_of(maps, raised={"unused": "vLLM's loader raised ValueError: no"})
    assert layout.targets == {}  # qk shares k with the transposed kv_t: it falls back too
    assert set(layout.fallback) == set(SPEC)
    assert "no stack of checkpoint slices" in layout.fallback["v"]
    assert "it fills o_scaled, which holds values the loader computed" in layout.fallback["o"]
    assert "filled partly" in layout.fallback["embed"]
    assert "raised ValueError" in layout.fallback["unused"]
    assert layout.fallback["q"] == "it fills qk with k, which travels whole"
    assert all(d.pieces[0].take == Slice() for d in layout.dest.values())  # whole, by name


def test_fall_back_on_request_and_the_whole_layout():
    maps = {"qkv": torch.cat([_numbers("q"), _numbers("k"), _numbers("v")]), "o": _numbers("o")}
    layout = _layout_of(maps)
    assert set(layout.targets) == {"qkv", "o"}
    less = fall_back(layout, SPEC, {"v": "asked"})
    assert set(less.targets) == {"o"}
    assert less.fallback["v"] == "asked" and "qkv" in less.fallback["q"]
    assert less.nbytes > layout.nbytes - SPEC["unused"].numel() * 4  # q, k, v whole now
    w = whole(SPEC, "why")
    assert (
        w.targets == {}
        and set(w.dest) == set(SPEC)
        and w.nbytes == sum(t.numel() * t.element_size() for t in SPEC.values())
    )


def test_expanded_probes_number_every_element_as_the_flat_numbering_does():
    """The replay sends each tensor as one line expanded to its shape, once per dim (no
    memory); what a copying loader leaves is put together into the flat numbers, and a loader
    that mixes elements across passes (or writes in a later pass only) is caught (0.5)."""
    numbering = _Numbering(SPEC)
    assert numbering.offsets == _offsets()
    for name in SPEC:
        probe = numbering.probe(name, 0)
        assert probe.shape == SPEC[name].shape and probe.stride()[-1] == 0 or probe.dim() == 1

    def loader(dim: int) -> torch.Tensor:  # what a fused, sliced copy leaves in a stand-in
        q, k = numbering.probe("q", dim), numbering.probe("k", dim)
        return torch.cat([q[H // 2 :], k[1:3]]).clone()

    got = numbering.numbers([loader(0), loader(1)])
    assert torch.equal(got, torch.cat([_numbers("q")[H // 2 :], _numbers("k")[1:3]]))
    norm = numbering.numbers([torch.cat([numbering.probe("unused", 0), -torch.ones(2)])])
    assert torch.equal(norm, torch.cat([_numbers("unused"), -torch.ones(2, dtype=torch.float64)]))
    crossed = loader(1)
    crossed[0, 0] = crossed[0, 1]  # its passes name element (row 4, col 1): that number
    crossed[0, 2] = 1.5  # a value no probe carries: computed
    mixed = numbering.numbers([loader(0), crossed])
    assert mixed[0, 0] == got[0, 1] and mixed[0, 2] == 0.5 and torch.equal(mixed[1:], got[1:])
    assert "no stack of checkpoint slices" in _layout_of({"qk": mixed}).fallback["k"] or (
        "computed" in _layout_of({"qk": mixed}).fallback["q"]
    )
    late = numbering.numbers([torch.full((2, H), -1.0, dtype=torch.float64), loader(1)[:2]])
    assert bool((late == 0.5).all())


def test_one_tensor_per_expert_matrix_maps_into_fused_experts_at_tp_rank_1_of_2():
    """A checkpoint with one tensor per expert matrix (gate and up [I, H], down [H, I]) into
    vLLM's fused experts of TP rank 1 of 2: ``w13`` [E, I, H] (each expert's half of gate,
    then of up) and ``w2`` [E, H, I/2] (each expert's half of down's columns). Both map, as
    the parameter viewed with its leading dims merged, and move exactly what the loader put."""
    experts, inter = 3, 4
    half = inter // 2
    spec: dict[str, torch.Tensor] = {}
    for e in range(experts):
        spec[f"experts.{e}.gate"] = torch.empty(inter, H, device="meta")
        spec[f"experts.{e}.up"] = torch.empty(inter, H, device="meta")
        spec[f"experts.{e}.down"] = torch.empty(H, inter, device="meta")
    offsets, at = {}, 1
    for n, t in spec.items():
        offsets[n], at = at, at + t.numel()

    def numbers(name: str) -> torch.Tensor:
        t = spec[name]
        return torch.arange(t.numel(), dtype=torch.float64).view(t.shape) + offsets[name]

    maps = {
        "w13": torch.stack(
            [
                torch.cat([numbers(f"experts.{e}.gate")[half:], numbers(f"experts.{e}.up")[half:]])
                for e in range(experts)
            ]
        ),
        "w2": torch.stack([numbers(f"experts.{e}.down")[:, half:] for e in range(experts)]),
    }
    layout = _layout(spec, offsets, _params(maps), maps, {})
    assert layout.fallback == {}
    w13, w2 = layout.dest["w13"], layout.dest["w2"]
    assert w13.shape == (experts * inter, H) and w2.shape == (experts * H, half)
    assert [(p.source, p.take, p.at) for p in w2.pieces] == [
        (f"experts.{e}.down", Slice(1, half, inter), e * H) for e in range(experts)
    ]
    assert len(w13.pieces) == 2 * experts
    assert layout.targets["w13"].shape == (experts, inter, H)  # vLLM's own shape
    source = SourceLayout.single(
        {n: torch.empty(t.shape, dtype=torch.float64) for n, t in spec.items()}
    )
    local = {n: numbers(n) for n in spec}
    got = {n: torch.full(d.shape, -1.0, dtype=torch.float64) for n, d in layout.dest.items()}
    dest = {n: type(d)(d.shape, torch.float64, d.pieces, d.dim) for n, d in layout.dest.items()}
    apply_runs(plan(source, dest, 0), local, got)
    for name, m in maps.items():
        assert torch.equal(got[name].view(m.shape), m), name


def test_fsdp_shards_of_stacked_experts_write_each_tp_worker_only_the_intersection():
    """A trainer holding the experts fused and stacked (transformers 5: ``gate_up_proj``
    [E, 2I, H], ``down_proj`` [E, H, I]) as FSDP shards along the experts, unevenly over 3 ranks
    (3, 3 and 2 experts), into TP rank 1 of 2's fused experts: every rank writes exactly the
    elements of its own experts that the worker keeps, no gather, every element once."""
    experts, inter = 8, 4
    half = inter // 2
    spec = {
        "experts.gate_up_proj": torch.empty(experts, 2 * inter, H, device="meta"),
        "experts.down_proj": torch.empty(experts, H, inter, device="meta"),
    }
    offsets = {"experts.gate_up_proj": 1, "experts.down_proj": 1 + experts * 2 * inter * H}

    def numbers(name: str) -> torch.Tensor:
        t = spec[name]
        return torch.arange(t.numel(), dtype=torch.float64).view(t.shape) + offsets[name]

    gate_up, down = numbers("experts.gate_up_proj"), numbers("experts.down_proj")
    maps = {  # what vLLM's loader puts in TP rank 1's parameters
        "w13": torch.cat([gate_up[:, half:inter], gate_up[:, inter + half :]], 1),
        "w2": down[:, :, half:].contiguous(),
    }
    layout = _layout(spec, offsets, _params(maps), maps, {})
    assert layout.fallback == {}
    dest = {n: type(d)(d.shape, torch.float64, d.pieces, d.dim) for n, d in layout.dest.items()}
    sizes = [3, 3, 2]
    source = SourceLayout.split(
        3,
        {n: (tuple(t.shape), torch.float64) for n, t in spec.items()},
        sizes={n: sizes for n in spec},
    )
    full = {n: numbers(n) for n in spec}
    got = {n: torch.full(d.shape, -1.0, dtype=torch.float64) for n, d in dest.items()}
    first = 0
    for rank, count in enumerate(sizes):
        box = slice(first, first + count)
        local = {n: full[n][box].contiguous().view(-1) for n in spec}
        runs = plan(source, dest, rank)
        # the intersection: its experts' slices of the worker's w13 and w2, nothing else
        assert sum(r.count for r in runs) == count * (inter * H + H * half)
        apply_runs(runs, local, got)
        first += count
    for name, m in maps.items():
        assert torch.equal(got[name].view(m.shape), m), name
