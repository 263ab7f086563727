"""vLLM's HTTP server with two tensor-parallel workers fed by a sharded trainer of two ranks (a
file of its own so that the suite's workers share the vLLM servers' time): each rank writes each
worker only the intersection of what it holds and what the worker keeps, every byte once."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.llama import kept_bytes
from helpers.vllm_peers import ShardedLlamaRank
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TP = 2


def test_a_sharded_trainer_writes_each_tp_worker_only_the_intersection(
    model_dir: Path, redis_url: str, reference, tmp_path: Path
):
    """Two trainer ranks holding tensor-parallel shards (column-parallel along dim 0, row-
    parallel along dim 1, norms replicated), two vLLM workers: rank r's shards are worker r's
    slices, so each rank writes its own worker everything but part of the replicated tensors
    (dealt round robin over the ranks) and the other worker only its share of those."""
    want, replicated = kept_bytes("llama")
    group = f"tp2-sharded-{uuid.uuid4().hex[:8]}"
    ranks = [
        ShardedLlamaRank(f"rank-{r}", redis_url, model_dir, group, 2, r, wait=False)
        for r in range(2)
    ]
    try:
        with VllmServer(model_dir, tmp_path / "server.log", tp=TP) as server:
            for r in ranks:
                r.started(60)
            server.post(
                "init_weight_transfer_engine",
                {"init_info": {"store": redis_url, "group": group, "timeout": 60}},
            )
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
