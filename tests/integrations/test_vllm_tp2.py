"""vLLM's HTTP server with two tensor-parallel workers (separate processes) takes each version as
each worker keeps it: its own slice of every column- and row-parallel weight, its part of the
fused q/k/v and gate/up, whole copies of what every rank holds (norms; the key/value heads of a
model with fewer of them than ranks). The bytes the trainer wrote to each worker are counted
(``Transport.traffic``, as transfers complete) and compared with what the model's shapes say a
worker keeps, computed here from the checkpoint and the rules of tensor parallelism, not from
the library's layout. After each of three updates vLLM's greedy tokens equal transformers'."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from helpers.llama import hf_model, kept_bytes
from helpers.vllm_peers import HttpTrainer, ShardedLlamaRank, send_counting
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TP = 2


@pytest.mark.parametrize(("kind", "slots"), [("llama", 2), ("qwen2-tied", 1)])
def test_each_tp_worker_receives_only_its_slice(
    kind: str, slots: int, model_dir_of, redis_url: str, reference, tmp_path: Path
):
    """The staging bound lets two copies of a worker's slice fit for the Llama, one for the
    Qwen2: each worker chooses the slots from it."""
    folder = model_dir_of(kind)
    want, _ = kept_bytes(kind)
    staging_gb = (slots + 0.5) * want / 2**30
    namespace = f"tp2-{uuid.uuid4().hex[:8]}"
    with (
        HttpTrainer("trainer", wait=False) as trainer,
        VllmServer(folder, tmp_path / "server.log", tp=TP) as server,
    ):
        assert server.generate() == reference(0, kind=kind)
        trainer.started(120)
        info = {"timeout": 60, "staging_gb": staging_gb}
        trainer.call("connect", server.url, redis_url, namespace, info, kind, timeout=120)
        states = server.transport_state()
        assert [s["mode"] for s in states] == ["sharded"] * TP, states
        assert all(s["fallback"] == {} for s in states), states
        assert [s["version_bytes"] for s in states] == [want] * TP
        assert [s["staging_slots"] for s in states] == [slots] * TP
        for s in states:  # copies of its slice, counted from its buffers; within the bound
            assert slots * want <= s["staging_bytes"] <= staging_gb * 2**30, s
        for version in (1, 2, 3):
            status, reasons, sent = send_counting(trainer, version)
            assert len(status) == TP and set(status.values()) == {"done"}, reasons
            assert sent == dict.fromkeys(status, want), (sent, want)
            assert server.get("weight_info") == {"weight_version": str(version)}
            assert server.generate() == reference(version, kind=kind), f"version {version}"

        # a trainer that dies between vLLM's update and finish calls (played here over HTTP)
        trainer.call("publish", 4, timeout=120)
        server.post("start_weight_update")
        server.post("update_weights", {"update_info": {"version": 4}})
        assert {s["held"] for s in server.transport_state()} == {4}
        assert server.get("weight_info") == {"weight_version": "3"}
        assert server.generate() == reference(3, kind=kind)  # serves what it reports
        # the trainer engine's next send closes the open update (loading nothing), then goes on
        status, reasons = trainer.call("send", 5, timeout=180)
        assert set(status.values()) == {"done"}, reasons
        assert server.get("weight_info") == {"weight_version": "5"}
        assert server.generate() == reference(5, kind=kind)


def test_a_sharded_trainer_writes_each_tp_worker_only_the_intersection(
    model_dir: Path, redis_url: str, reference, tmp_path: Path
):
    """Two trainer ranks holding tensor-parallel shards (column-parallel along dim 0, row-
    parallel along dim 1, norms replicated), two vLLM workers: rank r's shards are worker r's
    slices, so each rank writes its own worker everything but part of the replicated tensors
    (dealt round robin over the ranks) and the other worker only its share of those."""
    want, replicated = kept_bytes("llama")
    group = f"tp2-sharded-{uuid.uuid4().hex[:8]}"
    ranks = [ShardedLlamaRank(f"rank-{r}", redis_url, model_dir, group, 2, r, wait=False)
             for r in range(2)]  # fmt: skip
    try:
        with VllmServer(model_dir, tmp_path / "server.log", tp=TP) as server:
            for r in ranks:
                r.started(60)
            server.post("init_weight_transfer_engine", {"init_info": {"store": redis_url,
                        "group": group, "timeout": 60}})  # fmt: skip
            workers = [s["peer"] for s in server.transport_state()]
            assert all(w.endswith(f"-r{k}") for k, w in enumerate(workers)), workers
            before = [r.call("traffic") for r in ranks]
            for version in (1, 2):
                for r in ranks:
                    r.begin("publish", version, 60.0)
                for r in ranks:
                    status, reasons = r.end("publish", 120)
                    assert set(status.values()) == {"done"} and len(status) == TP, reasons
                after = [r.call("traffic") for r in ranks]
                sent = [
                    [after[r].get(w, 0) - before[r].get(w, 0) for w in workers] for r in range(2)
                ]
                before = after
                for k in range(TP):
                    assert sent[0][k] + sent[1][k] == want, sent  # every byte once
                    assert sent[1 - k][k] <= replicated, sent  # the other rank: replicated only
                server.post("start_weight_update")
                server.post("update_weights", {"update_info": {"version": version}})
                server.post("finish_weight_update", {"weight_version": str(version)})
                server.post("reset_prefix_cache")  # the KV values of the old weights
                assert server.generate() == reference(version), f"version {version}"
    finally:
        for r in ranks:
            r.stop()


def test_kept_bytes_follows_the_shapes():
    """The reference above: half of every split tensor, norms whole (the small Llama: 2 key/
    value heads split over 2 ranks; the tied Qwen2: 1 key/value head, whole on each rank)."""
    llama, llama_rep = kept_bytes("llama")
    qwen, qwen_rep = kept_bytes("qwen2-tied")
    full = sum(t.numel() * 4 for t in hf_model(0).parameters())  # type: ignore[attr-defined]
    assert llama == (full - llama_rep) // 2 + llama_rep
    assert qwen_rep > llama_rep  # k and v (and their biases) whole on both ranks
    assert torch.float32.itemsize == 4
