"""vLLM (the real engine, CPU build, offline ``LLM``) with room for half a copy of what its worker
keeps: each version streams through two buckets, part by part, into vLLM's reload inside its
finish call (integrations/vllm/streamed.py). The CPU build cannot be written in place (it
computes with packed copies), so this is what it does in bounded memory. After each update
vLLM's greedy tokens equal transformers' on the same weights; a trainer killed mid-stream leaves
a model named torn, and the next version makes it whole."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.llama import hf_model
from helpers.vllm_peers import (
    LlamaPublisher,
    ShardedTrainer,
    VllmProcess,
    init_info,
    send_on_both_ranks,
)
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm(model_dir: Path) -> Iterator[VllmProcess]:
    with VllmProcess("vllm-streamed", model_dir) as child:
        yield child


def _streamed_init(vllm: VllmProcess, store: TcpStore, group: str) -> tuple[int, int]:
    """Init ``group`` with room for half a copy of what the worker keeps: it streams. Returns
    (the bound in bytes, the parts of a version)."""
    vllm.call("init", init_info(store.url, f"{group}-sized"))
    one = vllm.call("engine_state")[0]["version_bytes"]
    bound = one // 2
    vllm.call("init", {**init_info(store.url, group), "staging_gb": bound / 2**30})
    (state,) = vllm.call("engine_state")
    assert state["mode"] == "streamed", state
    assert state["parts"] > 2, state
    assert 0 < state["staging_bytes"] <= bound, state
    return bound, state["parts"]


def test_a_version_too_large_for_staging_streams_through_two_buckets(
    vllm, store, reference, model_dir
):
    """The CPU build, where nothing is written in place: each version comes in parts of at
    most half the bound, each loaded into vLLM's reload as it lands, the next one landing
    meanwhile in the other bucket."""
    _, parts = _streamed_init(vllm, store, "streamed")
    with LlamaPublisher("trainer", store.url, model_dir, group="streamed", parts=parts) as trainer:
        for version in (1, 2, 3):
            trainer.begin("publish", version, 30.0)
            try:
                assert vllm.call("update", {"version": version, "timeout": 30}) == str(version)
            finally:
                status, reasons = trainer.end("publish", 90)
            assert set(status.values()) == {"done"}, reasons
            assert vllm.call("generate") == reference(version), f"version {version}"
        # nothing is written while vLLM serves: every part waits for a window, none comes
        status, _ = trainer.call("publish", 4, 2.0)
        assert set(status.values()) == {"excluded"}
        assert vllm.call("generate") == reference(3)


def test_a_trainer_killed_mid_stream_leaves_a_model_named_torn_and_the_next_version_whole(
    vllm, store, reference, model_dir
):
    group = "streamed-torn"
    _, parts = _streamed_init(vllm, store, group)
    first = LlamaPublisher(
        "trainer", store.url, model_dir, group=group, parts=parts, inline_bytes=0
    )
    try:
        first.begin("publish", 1, 30.0)
        assert vllm.call("update", {"version": 1, "timeout": 30}) == "1"
        assert set(first.end("publish", 90)[0].values()) == {"done"}
        # version 2's first part completes (and loads), the second never does; the trainer dies
        first.call("hold_notified_parts", 1)
        first.call("publish_nowait", 2, 30.0)
        with pytest.raises(ChildError, match=f"stopped after 1 of its {parts} parts"):
            vllm.call("update", {"version": 2, "timeout": 15})
        first.kill()
        assert first.proc.exitcode == -signal.SIGKILL
    finally:
        first.stop()
    assert vllm.call("engine_state")[0]["version"] == -2
    assert vllm.call("weight_version") == "1"  # vLLM's own: see the README's rules
    with LlamaPublisher("trainer", store.url, model_dir, group=group, parts=parts) as second:
        second.begin("publish", 3, 30.0)
        assert vllm.call("update", {"version": 3, "timeout": 30}) == "3"
        assert set(second.end("publish", 90)[0].values()) == {"done"}
        assert vllm.call("generate") == reference(3)
        assert vllm.call("engine_state")[0]["version"] == 3


def test_the_trainer_engine_streams_to_a_worker_from_a_sharded_trainer(store, reference, model_dir):
    """vLLM's own trainer API, two ranks each holding half of every tensor, a worker with room
    for half a copy: every rank publishes every part's group, rank 0 drives the update."""
    full = sum(p.numel() * 4 for p in hf_model(0).parameters())  # type: ignore[attr-defined]
    bound = full / 2 / 2**30
    with (
        ShardedTrainer("trainer", store.url, model_dir, 2, 0, staging_gb=bound) as rank0,
        ShardedTrainer("trainer", store.url, model_dir, 2, 1, staging_gb=bound) as rank1,
    ):
        for version in (1, 2):
            status, tokens = send_on_both_ranks(rank0, rank1, version)
            assert len(status) == 1 and set(status.values()) == {"done"}, status
            assert tokens == reference(version), f"version {version}"
        (state,) = rank0.call("engine_state")
        assert (state["mode"], state["version"]) == ("streamed", 2), state
        assert state["parts"] > 2 and 0 < state["staging_bytes"] <= bound * 2**30, state
