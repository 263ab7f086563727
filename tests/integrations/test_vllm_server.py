"""vLLM's HTTP server with two tensor-parallel workers (separate processes) receives weights
from a trainer process that uses the ``transport`` trainer engine through vLLM's own factory and
HTTP client, on Redis. Both workers load the same version (each fuses and shards the checkpoint
tensors itself), and the server's tokens equal transformers'. The namespace has a secret
(``$TRANSPORT_SECRET`` on both sides, never in vLLM's messages): a trainer without it finds no
subscriber to write (their group entries are signed) and the server keeps the version it has.
Then the server is killed and a new one started: the trainer's next update reaches it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.vllm_peers import HttpTrainer, LlamaPublisher
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_a_tp2_server_takes_each_version_and_a_restarted_server_rejoins(
    model_dir: Path, redis_url: str, reference, tmp_path: Path
):
    namespace = f"vllm-{uuid.uuid4().hex[:8]}"
    secret = {"TRANSPORT_SECRET": uuid.uuid4().hex}
    # the trainer child imports while the server starts
    with (
        HttpTrainer("trainer", env=secret, wait=False) as trainer,
        VllmServer(model_dir, tmp_path / "server-1.log", tp=2, env=secret) as server,
    ):
        assert server.generate() == reference(0)
        trainer.started(120)
        trainer.call("connect", server.url, redis_url, namespace, {"timeout": 60}, timeout=120)
        for version in (1, 2):
            status, reasons = trainer.call("send", version, timeout=180)
            # one subscriber per tensor-parallel worker, each with the whole version
            assert len(status) == 2 and set(status.values()) == {"done"}, reasons
            assert all("-r0" in n or "-r1" in n for n in status), status
            assert server.get("weight_info") == {"weight_version": str(version)}
            assert server.generate() == reference(version), f"version {version}"
        first_workers = set(status)
        # an outsider (the store and the hosts, no secret) cannot reach the workers
        with LlamaPublisher(
            "outsider", redis_url, model_dir, namespace=namespace, timeout=10
        ) as outsider:
            status, reasons = outsider.call("publish", 99, 10.0)
        # the group's entries are signed: it cannot even learn who subscribes
        assert status == {}, (status, reasons)
        assert server.generate() == reference(2)
        server.kill()

        # the new process at the same address (the trainer's client knows no other)
        with VllmServer(
            model_dir, tmp_path / "server-2.log", port=server.port, env=secret
        ) as again:
            assert again.generate() == reference(0)  # it starts from its checkpoint
            status, reasons = trainer.call("send", 3, timeout=180)
            new = [n for n, s in status.items() if s == "done"]
            assert len(new) == 1 and new[0] not in first_workers, (status, reasons)
            # the killed workers are reported, not waited on for ever
            assert {n for n, s in status.items() if s != "done"} <= first_workers
            assert again.get("weight_info") == {"weight_version": "3"}
            assert again.generate() == reference(3)
