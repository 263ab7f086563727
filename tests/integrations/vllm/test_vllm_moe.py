"""Mixtures of experts served by vLLM (CPU build) and updated through the ``transport`` backend:
after each version vLLM's greedy tokens equal transformers' on the same weights. vLLM's CPU
build prepares (repacks) its experts after loading and skips that step on a weight update; the
worker redoes it (integrations/vllm/experts.py), so these tests fail if vLLM ever computes
with anything but the trainer's weights.

The trainer holds the experts as transformers does (fused: ``mlp.experts.gate_up_proj``) or as a
saved checkpoint does (one tensor per expert matrix); both land exactly, each mapped by the
loader replay into vLLM's fused 3-D experts (nothing travels whole). Qwen3-MoE (q/k norms) and
Qwen2-MoE (a shared expert with its gate, q/k/v biases, a dense first layer); the bytes the
trainer wrote are counted against what the model's shapes say a worker keeps. One worker here
(TP = 1, every mode); vLLM's server at TP = 2 and with expert parallelism in test_vllm_moe_tp2.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.llama import MOE, expert_bytes, model_bytes
from helpers.model_publisher import ExpertParallelRank, ModelPublisher
from helpers.vllm_peers import VllmProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.slow]


@pytest.mark.parametrize("kind", MOE)
def test_experts_fused_or_one_per_matrix_land_exactly(kind, store, model_dir_of, reference):
    """One worker (TP = 1), trainers in turn: experts fused, then one tensor per expert matrix
    (the worker re-joins with the other names), three versions each; an expert-parallel
    trainer of two ranks; then room for less than a copy (streamed in parts)."""
    folder: Path = model_dir_of(kind)
    whole = model_bytes(kind)
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
                assert sum(sent) == whole and min(sent) >= expert_bytes(kind) // 2, sent
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
