"""Mixtures of experts served by vLLM (CPU build) and updated through the ``transport`` backend:
after each version vLLM's greedy tokens equal transformers' on the same weights. vLLM's CPU
build prepares (repacks) its experts after loading and skips that step on a weight update; the
worker redoes it (integrations/vllm/experts.py), so these tests fail if vLLM ever computes
with anything but the trainer's weights.

The trainer holds the experts as transformers does (fused: ``mlp.experts.gate_up_proj``) or as a
saved checkpoint does (one tensor per expert matrix); both land exactly, each mapped by the
loader replay into vLLM's fused 3-D experts (nothing travels whole). Qwen3-MoE (q/k norms) and
Qwen2-MoE (a shared expert with its gate, q/k/v biases, a dense first layer); the bytes the
trainer wrote are counted against what the model's shapes say a worker keeps."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.llama import MOE, hf_model, kept_bytes
from helpers.model_publisher import ExpertParallelRank, ModelPublisher
from helpers.vllm_peers import HttpTrainer, VllmProcess, send_counting
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _fused_experts(kind: str) -> list[str]:
    """The names of the fused gate/up experts tensors of the test model ``kind`` (one per MoE
    layer; a dense layer has none)."""
    return [
        n
        for n, _ in hf_model(0, kind=kind).named_parameters()
        if n.endswith("experts.gate_up_proj")
    ]  # type: ignore[attr-defined]


def _expert_bytes(kind: str) -> int:
    """Bytes of the routed experts (transformers' fused 3-D tensors)."""
    model = hf_model(0, kind=kind)
    return sum(t.numel() * t.element_size() for t in model.parameters() if t.dim() == 3)  # type: ignore[attr-defined]


def _model_bytes(kind: str) -> int:
    return sum(t.numel() * t.element_size() for t in hf_model(0, kind=kind).parameters())  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", MOE)
def test_experts_fused_or_one_per_matrix_land_exactly(kind, store, model_dir_of, reference):
    """One worker (TP = 1), trainers in turn: experts fused, then one tensor per expert matrix
    (the worker re-joins with the other names), three versions each; an expert-parallel
    trainer of two ranks; then room for less than a copy (streamed in parts)."""
    folder: Path = model_dir_of(kind)
    whole = _model_bytes(kind)
    with VllmProcess("vllm", folder) as vllm:
        assert vllm.call("generate") == reference(0, kind=kind)
        for names, versions in (("model", (1, 2, 3)), ("checkpoint", (4, 5, 6))):
            group = f"{kind}-{names}"
            vllm.call("init", {"store": store.url, "group": group, "timeout": 30, "names": names})
            (state,) = vllm.call("engine_state")
            assert state["mode"] == "sharded" and state["fallback"] == {}, state
            assert state["version_bytes"] == whole
            with ModelPublisher(f"trainer-{names}", store.url, kind, group, names) as trainer:
                if names == "checkpoint":  # 3 matrices of 8 experts per MoE layer
                    assert trainer.call("count") > 3 * 8
                for version in versions:
                    before = trainer.call("traffic")
                    status, reasons = trainer.call("publish", version)
                    assert set(status.values()) == {"done"}, reasons
                    sent = {n: b - before.get(n, 0) for n, b in trainer.call("traffic").items()}
                    assert list(sent.values()) == [whole], sent
                    assert vllm.call("update", {"version": version}) == str(version)
                    assert vllm.call("generate") == reference(version, kind=kind), (names, version)
        # an expert-parallel trainer of two ranks, each holding half of the experts: each writes
        # its own experts and its share of the rest, no gather, every byte once
        group = f"{kind}-ep-trainer"
        vllm.call("init", {"store": store.url, "group": group, "timeout": 30})
        ranks = [ExpertParallelRank(f"ep-{r}", store.url, kind, group, 2, r) for r in range(2)]
        try:
            for r in ranks:
                r.started(90)
            for version in (7, 8):
                before = [r.call("traffic") for r in ranks]
                for r in ranks:
                    r.begin("publish", version, 30.0)
                for r in ranks:
                    status, reasons = r.end("publish", 90)
                    assert set(status.values()) == {"done"}, reasons
                after = [r.call("traffic") for r in ranks]
                sent = [
                    sum(a.values()) - sum(b.values()) for a, b in zip(after, before, strict=True)
                ]
                assert sum(sent) == whole and min(sent) >= _expert_bytes(kind) // 2, sent
                assert vllm.call("update", {"version": version}) == str(version)
                assert vllm.call("generate") == reference(version, kind=kind), version
        finally:
            for r in ranks:
                r.stop()
        # room for less than a copy: each version streams in parts into vLLM's reload (buckets of
        # 0.4 of a copy hold the largest tensor, one layer's fused gate/up experts)
        group = f"{kind}-streamed"
        room = 0.8 * whole / 2**30
        info = {"store": store.url, "group": group, "timeout": 30, "staging_gb": room}
        vllm.call("init", info)
        (state,) = vllm.call("engine_state")
        assert state["mode"] == "streamed" and state["parts"] > 2, state
        with ModelPublisher("trainer-streamed", store.url, kind, group, parts=state["parts"]) as t:
            for version in (9, 10):
                t.begin("publish", version, 30.0)
                try:
                    assert vllm.call("update", {"version": version, "timeout": 30}) == str(version)
                finally:
                    status, reasons = t.end("publish", 90)
                assert set(status.values()) == {"done"}, reasons
                assert vllm.call("generate") == reference(version, kind=kind), version


def test_experts_no_update_can_place_exactly_are_refused_before_a_byte_moves(store, model_dir_of):
    """vLLM's CPU kernel pads experts of intermediate size 48 to 64; its weight reload cannot
    copy into the padded tensors. The worker refuses to join, naming the layers and the way
    out, in every mode: no trainer ever finds it, and vLLM keeps serving what it loaded."""
    kind = "qwen3-moe-padded"
    with VllmProcess("vllm", model_dir_of(kind)) as vllm:
        before = vllm.call("generate")
        for mode in ("auto", "whole"):
            info = {"store": store.url, "group": f"padded-{mode}", "timeout": 30, "mode": mode}
            with pytest.raises(
                ChildError, match=r"2 mixture-of-experts layer\(s\).*multiple of 32"
            ):
                vllm.call("init", info)
            assert vllm.call("engine_state")[0]["peer"] is None  # joined no group
        assert vllm.call("generate") == before


@pytest.mark.parametrize("kind", MOE)
def test_each_tp_worker_receives_its_slice_of_every_expert(
    kind, store, model_dir_of, reference, tmp_path: Path
):
    """vLLM's server at TP = 2, the trainer through vLLM's own trainer factory with
    ``ModuleSource(model)`` of the transformers model and vLLM's HTTP client (as the README
    shows): each worker receives exactly its slice (half of every expert along the
    intermediate size, the routers whole), about half the model; then a trainer whose source
    names one tensor per expert matrix."""
    folder: Path = model_dir_of(kind)
    want, _ = kept_bytes(kind)
    assert want <= 0.55 * _model_bytes(kind)
    trainer = HttpTrainer("trainer", wait=False)
    with trainer, VllmServer(folder, tmp_path / "server.log", tp=2) as server:
        assert server.generate() == reference(0, kind=kind)
        trainer.started(120)
        version = 0
        for names, count in (("model", 3), ("checkpoint", 1)):
            namespace = f"moe-{names}-{uuid.uuid4().hex[:6]}"
            info = {"timeout": 60}
            trainer.call(
                "connect", server.url, store.url, namespace, info, kind, names, timeout=120
            )
            states = server.transport_state()
            assert [s["mode"] for s in states] == ["sharded"] * 2, states
            assert all(s["fallback"] == {} for s in states), [s["fallback"] for s in states]
            assert [s["version_bytes"] for s in states] == [want] * 2
            every = {n.rsplit(".", 1)[0]: list(range(8)) for n in _fused_experts(kind)}
            assert all(s["experts"] == every for s in states), states  # a slice of each
            for _ in range(count):
                version += 1
                status, reasons, sent = send_counting(trainer, version)
                assert len(status) == 2 and set(status.values()) == {"done"}, reasons
                assert sent == dict.fromkeys(status, want), (sent, want)
                assert server.get("weight_info") == {"weight_version": str(version)}
                assert server.generate() == reference(version, kind=kind), (names, version)


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
