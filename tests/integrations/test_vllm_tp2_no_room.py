"""vLLM's HTTP server with two tensor-parallel workers and no room for one staging copy of what
a worker keeps: a server that computes with its parameters as stored (as vLLM's GPU builds do;
helpers/as_stored) takes each version straight into them, vLLM's CPU build streams it through
two buckets; both inside vLLM's finish call, each worker only its slice (counted), and nothing is
written while vLLM serves. After each of three updates vLLM's greedy tokens equal transformers'."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from helpers.llama import kept_bytes
from helpers.vllm_peers import AS_STORED_PATH, HttpTrainer, send_counting
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TP = 2


@pytest.mark.parametrize("mode", ["inplace", "streamed"])
def test_tp_workers_with_no_room_for_a_copy_receive_their_slices_inside_finish(
    mode: str, model_dir: Path, redis_url: str, reference, tmp_path: Path
):
    """Room for half a copy of a worker's slice: a server that computes with its parameters as
    stored (as vLLM's GPU builds do; helpers/as_stored) writes each version straight into them,
    vLLM's CPU build streams it through two buckets; both inside vLLM's finish call, each worker
    only its slice, and nothing written while vLLM serves."""
    want, _ = kept_bytes("llama")
    bound = want // 2
    namespace = f"tp2-{mode}-{uuid.uuid4().hex[:8]}"
    path = os.pathsep.join(p for p in (str(AS_STORED_PATH), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path} if mode == "inplace" else {}
    with (
        HttpTrainer("trainer", wait=False) as trainer,
        VllmServer(model_dir, tmp_path / "server.log", tp=TP, env=env) as server,
    ):
        trainer.started(120)
        info = {"timeout": 60, "staging_gb": bound / 2**30}
        trainer.call("connect", server.url, redis_url, namespace, info, timeout=120)
        states = server.transport_state()
        assert [s["mode"] for s in states] == [mode] * TP, states
        for s in states:  # in place none; streamed two buckets within the bound
            assert (
                s["staging_bytes"] == 0 if mode == "inplace" else 0 < s["staging_bytes"] <= bound
            ), s
            assert (s["parts"] > 2) == (mode == "streamed"), s
        for version in (1, 2, 3):
            status, reasons, sent = send_counting(trainer, version)
            assert len(status) == TP and set(status.values()) == {"done"}, reasons
            assert sent == dict.fromkeys(status, want), (sent, want)  # every part, counted
            assert server.get("weight_info") == {"weight_version": str(version)}
            assert [s["version"] for s in server.transport_state()] == [version] * TP
            assert server.generate() == reference(version), f"version {version}"
        # a publish while vLLM serves is never credited: it excludes both workers at its
        # deadline, and vLLM serves version 3 whole
        status, _ = trainer.call("publish", 4, 3.0, timeout=120)
        assert set(status.values()) == {"excluded"} and len(status) == TP, status
        assert server.generate() == reference(3)
