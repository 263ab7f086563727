"""On ``PYTHONPATH``, this folder makes every Python process that imports vLLM (a server, its
engine core, its workers) compute each linear layer with its parameter as stored, as vLLM's GPU
builds do, instead of a copy vLLM's CPU build packs for oneDNN: a test can then run workers that
receive in place on the CPU build. Python imports one ``sitecustomize`` at start, the first on
its path: this one also runs the test processes' own (helpers/startup). Nothing happens until
vLLM's layer utilities are imported."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

STARTUP = Path(__file__).resolve().parent.parent / "startup"
TARGET = "vllm.model_executor.layers.utils"


def as_stored(layer: Any, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch, replaced: the layer computes with ``torch``'s linear over its
    parameter as stored."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear


def patch(utils: Any) -> None:
    utils.dispatch_cpu_unquantized_gemm = as_stored


runpy.run_path(str(STARTUP / "sitecustomize.py"))  # which puts its folder on the path
from on_import import patch_on_import  # noqa: E402

patch_on_import(TARGET, patch)
