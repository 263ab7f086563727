"""When a vLLM worker may write a version in place (transport/integrations/vllm/as_stored.py),
without a vLLM engine: modules standing in for vLLM's layers, each with the quantization method
and, on the CPU build, the kernel vLLM picked. Every rule that refuses is named, per parameter."""

from __future__ import annotations

import pytest
import torch

from transport.integrations.vllm.as_stored import live_tensors, refusals
from transport.integrations.vllm.shards import Target, WorkerLayout
from transport.weights import DestTensor, Piece

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


class UnquantizedLinearMethod:  # the names vLLM's methods have
    pass


class Fp8LinearMethod:
    pass


def _layer(shape: tuple[int, ...], method: object = None, kernel: object = None) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    if method is not None:
        layer.quant_method = method
    if kernel is not None:
        layer.cpu_linear = kernel
    return layer


def _layout(model: torch.nn.Module, rows: dict[str, int] | None = None) -> WorkerLayout:
    targets, dest = {}, {}
    for name, p in model.named_parameters():
        n = (rows or {}).get(name, p.shape[0])
        targets[name] = Target((name,), tuple(p.shape), p.dtype, n)
        dest[name] = DestTensor((n, *p.shape[1:]), p.dtype, (Piece(name),))
    return WorkerLayout(dest, targets)


def test_plain_layers_computing_with_their_parameters_are_written_in_place():
    model = torch.nn.Module()
    model.proj = _layer((8, 4), UnquantizedLinearMethod(), torch.nn.functional.linear)
    model.norm = _layer((4,))  # no quantization method: used as stored
    model.head = _layer((10, 4), UnquantizedLinearMethod(), torch.nn.functional.linear)
    layout = _layout(model, rows={"head.weight": 7})  # three padding rows
    assert refusals(model, layout) == {}
    live = live_tensors(model, layout)
    assert live["proj.weight"].data_ptr() == model.proj.weight.data_ptr()
    assert live["head.weight"].shape == (7, 4)  # the rows the checkpoint fills
    assert live["head.weight"].data_ptr() == model.head.weight.data_ptr()


def test_every_rule_that_refuses_is_named():
    model = torch.nn.Module()
    packed = lambda x, w, b: torch.nn.functional.linear(x, w, b)  # noqa: E731 - a packed kernel
    model.packed = _layer((8, 4), UnquantizedLinearMethod(), packed)
    model.fp8 = _layer((8, 4), Fp8LinearMethod(), torch.nn.functional.linear)
    model.dropped = _layer((8, 4), UnquantizedLinearMethod(), torch.nn.functional.linear)
    model.strided = _layer((4, 8))
    layout = _layout(model)
    # vLLM's CPU build drops a packed weight; another memory order than the loader's
    model.dropped.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    model.strided.weight = torch.nn.Parameter(torch.zeros(8, 4).t(), requires_grad=False)
    fallback = {**layout.fallback, "rotary": "its loader computes values"}
    layout = WorkerLayout(layout.dest, layout.targets, fallback)
    why = refusals(model, layout)
    assert why["packed.weight"] == (
        "vLLM's CPU build computes with a packed copy of it (oneDNN), not with it"
    )
    assert why["fp8.weight"] == "its layer's Fp8LinearMethod may transform it after loading"
    assert why["dropped.weight"].startswith("vLLM computes with it as (0,) torch.float32")
    assert why["strided.weight"] == (
        "vLLM computes with it in another memory order than its loader writes it"
    )
    assert why["rotary"] == "it travels whole through vLLM's loader (its loader computes values)"
    assert len(why) == 5


def test_tied_names_must_be_one_tensor():
    model = torch.nn.Module()
    model.embed = _layer((10, 4))
    model.head = _layer((10, 4))
    tied = WorkerLayout(
        {"embed.weight": DestTensor((10, 4), torch.float32, (Piece("embed.weight"),))},
        {"embed.weight": Target(("embed.weight", "head.weight"), (10, 4), torch.float32, 10)},
    )
    assert "are separate tensors" in refusals(model, tied)["embed.weight"]
    model.head = model.embed  # tied: one module, one tensor
    assert refusals(model, tied) == {}
