"""LoRA adapters into a running vLLM server with two tensor-parallel workers (separate
processes), through the adapter routes (transport/integrations/vllm/lora_routes.py) and the
workers' LoRA mode (modes/lora.py). Each worker is written only the slice of A or B its LoRA
layers keep (bytes counted against vLLM's rules computed here from the model's shapes), vLLM's
greedy tokens naming the adapter equal transformers + peft's on the trainer's adapter after each
version, and the base model is neither sent nor changed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.lora_peers import HttpLoraTrainer, slice_bytes
from helpers.vllm_server import LORA_ARGS, VllmServer
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.timeout(900), pytest.mark.lora, pytest.mark.slow]

TP = 2
RANK = 8


@dataclass
class Shared:
    server: VllmServer
    store: str
    base: list[list[int]]


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    logs = tmp_path_factory.mktemp("lora-server")
    store = TcpStore("127.0.0.1", 0, hosting="yes")
    try:
        with VllmServer(model_dir, logs / "server.log", tp=TP, args=LORA_ARGS) as server:
            yield Shared(server, f"tcp://127.0.0.1:{store.port}?host=no", server.generate())
    finally:
        store.close()


def test_each_tp_worker_takes_its_slices_and_serves_each_version_exactly(shared: Shared) -> None:
    server = shared.server
    with HttpLoraTrainer("policy") as trainer:
        trainer.call("connect", server.url, shared.store, "policy", "default", RANK, timeout=120)
        served = []
        for version in (1, 2, 3):
            got = trainer.call("send", version, timeout=240)
            assert sorted(got["written"].values()) == [slice_bytes(RANK, TP)] * TP, got
            assert server.generate("policy") == got["peft"], f"version {version}"
            assert server.generate() == shared.base, "the base model changed"
            served.append(got["peft"])
        assert served[0] != shared.base and len({str(s) for s in served}) == 3
        states = server.transport_state()
        adapters = [s["adapters"]["default/policy"] for s in states]
        assert [a["version"] for a in adapters] == [3] * TP, adapters
        assert all(a["registered"] for a in adapters), adapters
        assert [a["version_bytes"] for a in adapters] == [slice_bytes(RANK, TP)] * TP
