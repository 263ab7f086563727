"""LoRA adapters into vLLM's LoRA slots from memory (transport/integrations/vllm/modes/lora.py):
a peft trainer publishes its adapter as adapter ``policy``; after each of three versions vLLM's
greedy tokens naming it equal transformers + peft's on the trainer's adapter, vLLM's tokens
without it stay the base model's, and the trainer wrote each worker exactly the adapter's bytes
(no byte of the base)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.lora_peers import LoraEngine, slice_bytes
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.lora]


def test_adapter_versions_land_exactly_in_process(model_dir: Path, store: TcpStore) -> None:
    url = f"tcp://127.0.0.1:{store.port}?host=no"
    with LoraEngine("lora", str(model_dir), url, rank=8) as engine:
        base = None
        seen = []
        for version in (1, 2, 3):
            got = engine.call("send", version, timeout=240)
            assert got["vllm"] == got["peft"], (version, got)
            assert got["vllm"] != got["base"], "the adapter must change the tokens"
            base = base or got["base"]
            assert got["base"] == base, "the base model changed"
            assert list(got["written"].values()) == [slice_bytes(8, 1)], got["written"]
            seen.append(got["vllm"])
        assert len({str(s) for s in seen}) == 3, "each version must serve its own tokens"
        (state,) = engine.call("state")
        adapter = state["adapters"]["default/policy"]
        assert adapter["version"] == 3 and adapter["registered"], adapter
