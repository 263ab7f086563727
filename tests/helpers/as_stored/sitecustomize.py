"""On ``PYTHONPATH``, this folder makes every Python process that imports vLLM (a server, its
engine core, its workers) compute each linear layer with its parameter as stored, as vLLM's GPU
builds do, instead of a copy vLLM's CPU build packs for oneDNN: a test can then run workers that
receive in place on the CPU build. Python imports ``sitecustomize`` at start; nothing happens
until vLLM's layer utilities are imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

TARGET = "vllm.model_executor.layers.utils"


def as_stored(layer: Any, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch, replaced: the layer computes with ``torch``'s linear over its
    parameter as stored."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear


def patch(utils: Any) -> None:
    utils.dispatch_cpu_unquantized_gemm = as_stored


class _Finder(importlib.abc.MetaPathFinder):
    """Patches vLLM's layer utilities as they are imported (once)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if TARGET in sys.modules:
    patch(sys.modules[TARGET])
else:
    sys.meta_path.insert(0, _Finder())
