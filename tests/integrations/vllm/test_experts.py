"""Which of vLLM's fused mixture-of-experts layers a weight update can place exactly, and the
step the worker redoes after a reload (transport/integrations/vllm/experts.py), without a vLLM
engine: modules standing in for vLLM's MoE layers, each with vLLM's own experts kernel classes
(made without their constructors) and the loader format vLLM's reload records."""

from __future__ import annotations

import pytest
import torch

from transport.integrations.vllm import experts

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

E, N, H = 4, 32, 16  # experts, intermediate size, hidden size


def _kernels() -> tuple[type, type, type]:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUExpertsFp8,
        CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    class Plain(CPUUnquantizedExperts):  # a kernel without a post-load step of its own
        process_weights_after_loading = FusedMoEExperts.process_weights_after_loading

    class Repacking(CPUExpertsFp8):  # a kernel of another kind that prepares its weights
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            raise AssertionError("never run by the worker")

    class CpuKernel(CPUUnquantizedExperts):  # vLLM's CPU kernel, its step counted
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.prepared += 1

    return Plain, Repacking, CpuKernel


def _layer(kernel: type, inter: int = N, recorded_inter: int = N) -> torch.nn.Module:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * inter, H), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(E, H, inter), requires_grad=False)
    layer.prepared = 0
    method = torch.nn.Module()
    method.moe_kernel = type("Kernel", (), {})()
    method.moe_kernel.fused_experts = object.__new__(kernel)
    layer.quant_method = method
    recorded = {
        "w13_weight": torch.empty(E, 2 * recorded_inter, H, device="meta"),
        "w2_weight": torch.empty(E, H, recorded_inter, device="meta"),
    }
    get_layerwise_info(layer).restore_metadata = (recorded, {})
    return layer


def test_kernels_the_worker_can_and_cannot_update_exactly():
    plain, repacking, cpu = _kernels()
    model = torch.nn.Module()
    model.plain = _layer(plain)
    model.cpu = _layer(cpu)
    model.other = _layer(repacking)
    model.padded = _layer(cpu, inter=64, recorded_inter=48)  # padded to the kernel's 32
    refused = experts.refusals(model)
    assert set(refused) == {"other", "padded"}
    assert "Repacking prepares the expert weights after loading" in refused["other"]
    assert "padded to (4, 128, 16)" in refused["padded"] and "multiple of 32" in refused["padded"]


def test_the_step_is_redone_only_for_layers_that_took_the_version():
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    plain, _, cpu = _kernels()
    model = torch.nn.Module()
    model.done = _layer(cpu)  # processed during the reload: its info was reset
    model.late = _layer(cpu)  # took part of the version: processed when finalized
    model.none = _layer(cpu)  # took nothing: vLLM puts its prepared tensors back
    model.plain = _layer(plain)
    for name in ("late", "none"):
        info = get_layerwise_info(getattr(model, name))
        info.load_numel_total = E * 3 * N * H
        info.load_numel = 0 if name == "none" else 5
    layers = experts.reloaded(model)
    assert layers == ["done", "late"]
    experts.redo(model, layers)
    assert [model.done.prepared, model.late.prepared, model.none.prepared] == [1, 1, 0]
