"""Fixtures of the vLLM integration tests: the small Llama's folder and transformers' reference
tokens per version. The test command installs vLLM's CPU build (``TRANSPORT_TEST_VLLM=1``):
there a missing vLLM fails these tests instead of skipping them."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.llama import greedy, hf_model, make_model
from transport.store.tcp import TcpStore


def _need_vllm() -> None:
    # found, not imported: importing vLLM costs seconds of CPU, and the engines run in children
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("TRANSPORT_TEST_VLLM") == "1":
            pytest.fail("vLLM is not installed, and the test command promised it", pytrace=False)
        pytest.skip("vLLM is not installed (tests/run.sh installs its CPU build)")


@pytest.fixture(scope="session")
def model_dir_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``model_dir_of(kind)``: the small model ``kind`` (helpers.llama.KINDS) with the weights of
    version 0, saved as a checkpoint vLLM loads (once per session)."""
    _need_vllm()
    made: dict[str, Path] = {}

    def folder(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_model(tmp_path_factory.mktemp(kind), version=0, kind=kind)
        return made[kind]

    return folder


@pytest.fixture(scope="session")
def model_dir(model_dir_of: Callable[[str], Path]) -> Path:
    """The small Llama (untied) with the weights of version 0."""
    return model_dir_of("llama")


@pytest.fixture(scope="session")
def reference() -> Callable[..., list[list[int]]]:
    """``reference(v)``: transformers' greedy tokens for every prompt on version ``v``'s weights
    of the small Llama (``reference(v, through=torch.bfloat16)``: on those weights rounded to
    bfloat16; ``reference(v, kind=...)``: of another test model)."""
    cache: dict[tuple[int, object, str], list[list[int]]] = {}

    def tokens(version: int, through: object = None, kind: str = "llama") -> list[list[int]]:
        key = (version, through, kind)
        if key not in cache:
            cache[key] = greedy(hf_model(version, through, kind))  # type: ignore[arg-type]
        return cache[key]

    return tokens


@pytest.fixture(scope="module")
def store() -> Iterator[TcpStore]:
    """The embedded store, hosted by the test process (one per test module)."""
    s = TcpStore("127.0.0.1", 0, hosting="yes")
    yield s
    s.close()
