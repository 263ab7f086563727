"""Fixtures of the vLLM integration tests: the small Llama's folder and transformers' reference
tokens per version. The test command installs vLLM's CPU build (``TRANSPORT_TEST_VLLM=1``):
there a missing vLLM fails these tests instead of skipping them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.llama import greedy, hf_model, make_model


def _need_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("TRANSPORT_TEST_VLLM") == "1":
            pytest.fail("vLLM is not installed, and the test command promised it", pytrace=False)
        pytest.skip("vLLM is not installed (tests/run.sh installs its CPU build)")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small Llama with the weights of version 0, saved as a checkpoint vLLM loads."""
    _need_vllm()
    return make_model(tmp_path_factory.mktemp("llama"), version=0)


@pytest.fixture(scope="session")
def reference() -> Callable[..., list[list[int]]]:
    """``reference(v)``: transformers' greedy tokens for every prompt on version ``v``'s weights
    (``reference(v, through=torch.bfloat16)``: on those weights rounded to bfloat16)."""
    cache: dict[tuple[int, object], list[list[int]]] = {}

    def tokens(version: int, through: object = None) -> list[list[int]]:
        if (version, through) not in cache:
            cache[(version, through)] = greedy(hf_model(version, through))  # type: ignore[arg-type]
        return cache[(version, through)]

    return tokens
