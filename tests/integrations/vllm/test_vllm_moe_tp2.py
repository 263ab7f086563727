"""Mixtures of experts served by vLLM's HTTP server (CPU build) at TP = 2 and updated through the
``transport`` backend, the trainer through vLLM's own trainer factory: each tensor-parallel
worker receives exactly its slice of every expert, and with expert parallelism exactly the whole
experts it hosts (test_vllm_moe.py: one worker, every mode, both models, the same checks).

Two servers, one after the other (a server's start is most of what such a test costs on this
kind of machine): the Qwen2-MoE at TP = 2 (shared and routed experts, tied embeddings), shared
by the first two tests in order; then the Qwen3-MoE with expert parallelism. The Qwen3-MoE's
tensor-parallel slices are the Qwen2-MoE's rules on the same fused experts (its single-worker
tests are in test_vllm_moe.py), and its server here is the expert-parallel one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.llama import fused_expert_names, kept_bytes, model_bytes
from helpers.tp2_updates import Updates, run_updates, staging_for
from helpers.vllm_peers import HttpTrainer, send_counting
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.slow]


@dataclass
class Served:
    """The module's server of a mixture of experts at TP = 2 and its trainer (vLLM's trainer
    factory, over vLLM's HTTP client), shared by the tests of that model, which run in order;
    ``version``: the version the server serves (each test starts there)."""

    kind: str
    server: VllmServer
    trainer: HttpTrainer
    version: int = 0


@pytest.fixture(scope="module")
def served(model_dir_of, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    kind = "qwen2-moe"
    folder: Path = model_dir_of(kind)
    log = tmp_path_factory.mktemp(f"{kind}-server") / "server.log"
    # the trainer child imports while the server starts
    with (
        HttpTrainer("trainer", wait=False) as trainer,
        VllmServer(folder, log, tp=2) as server,
    ):
        trainer.started(120)
        yield Served(kind, server, trainer)


def test_each_tp_worker_receives_its_slice_of_every_expert(served: Served, store, reference):
    """vLLM's server at TP = 2, the trainer through vLLM's own trainer factory with
    ``ModuleSource(model)`` of the transformers model and vLLM's HTTP client (as the README
    shows): each worker receives exactly its slice (half of every expert along the
    intermediate size, the routers whole), about half the model; then a trainer whose source
    names one tensor per expert matrix."""
    kind, server, trainer = served.kind, served.server, served.trainer
    want, _ = kept_bytes(kind)
    assert want <= 0.55 * model_bytes(kind)
    assert server.generate() == reference(served.version, kind=kind)
    for names, count in (("model", 3), ("checkpoint", 1)):
        namespace = f"moe-{names}-{uuid.uuid4().hex[:6]}"
        info = {"timeout": 60}
        trainer.call("connect", server.url, store.url, namespace, info, kind, names, timeout=120)
        states = server.transport_state()
        assert [s["mode"] for s in states] == ["sharded"] * 2, states
        assert all(s["fallback"] == {} for s in states), [s["fallback"] for s in states]
        assert [s["version_bytes"] for s in states] == [want] * 2
        every = {n.rsplit(".", 1)[0]: list(range(8)) for n in fused_expert_names(kind)}
        assert all(s["experts"] == every for s in states), states  # a slice of each
        for _ in range(count):
            served.version += 1
            status, reasons, sent = send_counting(trainer, served.version)
            assert len(status) == 2 and set(status.values()) == {"done"}, reasons
            assert sent == dict.fromkeys(status, want), (sent, want)
            assert server.get("weight_info") == {"weight_version": str(served.version)}
            assert server.generate() == reference(served.version, kind=kind), (
                names,
                served.version,
            )


def test_a_tied_model_with_room_for_one_copy_keeps_one_slot_and_outlives_a_trainer_gone(
    served: Served, store, reference
):
    """The Qwen2-MoE's embeddings are tied (one tensor, split over the vocabulary, which the
    output layer reads too). With room for one copy of a worker's slice, each worker keeps one
    staging slot; three updates, each worker's bytes counted and the tokens compared; then a
    trainer that dies between vLLM's update and finish calls (helpers/tp2_updates.py, as the
    Llama's in test_vllm_tp2.py)."""
    kind = served.kind
    namespace = f"slot-{uuid.uuid4().hex[:6]}"
    run = Updates(kind, 1, staging_for(kind, 1), store.url, namespace, served=served.version)
    served.version = run_updates(served.trainer, served.server, run, reference)


def test_expert_parallel_workers_receive_only_the_experts_they_host(
    store, model_dir_of, tmp_path: Path
):
    """vLLM's server at TP = 2 with ``--enable-expert-parallel``: each worker hosts half of the
    experts, whole, as vLLM's own expert map (read from the worker) says; its layout takes
    exactly those (its state says which), every byte of what it keeps and nothing of the other
    experts, and vLLM takes each version. vLLM's CPU build loads and updates such a model but
    its worker dies at the first forward pass with an expert map (vLLM 0.32), so the tokens
    after an expert-parallel update are left to a GPU machine; the tensor-parallel tests above
    compare them."""
    kind = "qwen3-moe"
    folder: Path = model_dir_of(kind)
    trainer = HttpTrainer("trainer", wait=False)
    args = ("--enable-expert-parallel",)
    with trainer, VllmServer(folder, tmp_path / "server.log", tp=2, args=args) as server:
        trainer.started(120)
        namespace = f"moe-ep-{uuid.uuid4().hex[:6]}"
        trainer.call("connect", server.url, store.url, namespace, {"timeout": 60}, kind)
        states = server.transport_state()
        hosted = server.post("collective_rpc", {"method": "experts_hosted"})["results"]
        assert all(s["fallback"] == {} for s in states), [s["fallback"] for s in states]
        layers = [f"model.layers.{k}.mlp.experts" for k in range(2)]
        for state, mine in zip(states, hosted, strict=True):
            want = {layer: mine[f"{layer}.routed_experts"] for layer in layers}
            assert state["experts"] == want, (state["experts"], mine)
            assert all(len(ids) == 4 for ids in want.values())  # whole experts, half of them
        assert sorted(x for h in hosted for x in h[f"{layers[0]}.routed_experts"]) == list(range(8))
        want_bytes, _ = kept_bytes(kind)  # half of the experts whole: as many bytes as a slice
        for version in (1, 2):
            status, reasons, sent = send_counting(trainer, version)
            assert set(status.values()) == {"done"}, reasons
            assert sent == {s["peer"]: want_bytes for s in states}, sent
            assert server.get("weight_info") == {"weight_version": str(version)}
        assert [s["version"] for s in server.transport_state()] == [2, 2]
