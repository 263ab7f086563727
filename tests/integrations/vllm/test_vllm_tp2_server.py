"""vLLM's HTTP server with two tensor-parallel workers (separate processes), one server of the
small Llama shared by the tests of this file, which run in order (a server's start is most of
what such a test costs on this kind of machine); on Redis, with a secret (``$TRANSPORT_SECRET``
on both sides, never in vLLM's messages). The server computes with its parameters as stored,
as vLLM's GPU builds do (helpers/as_stored; vLLM's CPU build computes with packed copies), so
that it can be written in place too. Each test starts from the version the server serves and
checks that first: whatever a test leaves behind shows in the next one.

- The ``transport`` trainer engine through vLLM's own factory and HTTP client: both workers
  load each version (each its own slice), and the server's tokens equal transformers'; a
  trainer without the secret finds no subscriber to write (their group entries are signed).
- A sharded trainer of two ranks writes each worker only the intersection of what it holds
  and what the worker keeps, every byte once.
- Delta versions through the trainer engine: each worker receives only the changes of its own
  slice, and serves the tokens of the same version sent whole.
- No room for one staging copy of a worker's slice: each version goes straight into the
  parameters, or when asked streams through two buckets (vLLM's CPU build's choice), inside
  vLLM's finish call, each worker only its slice (counted), and nothing is written while vLLM
  serves.
- Last: the server is killed and a new one started at its address; the trainer's next update
  reaches it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.llama import STEPS, kept_bytes
from helpers.vllm_peers import (
    AS_STORED_PATH,
    HttpTrainer,
    LlamaPublisher,
    ShardedLlamaRank,
    send_counting,
)
from helpers.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.slow]

TP = 2


@dataclass
class Shared:
    """The module's server, its trainer (connected by the first test), and the version the
    server serves (every test starts there and leaves the newest it loaded)."""

    server: VllmServer
    trainer: HttpTrainer
    secret: dict[str, str]
    version: int = 0

    def next_versions(self, count: int) -> list[int]:
        return list(range(self.version + 1, self.version + 1 + count))


def as_stored(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a server that computes with its parameters as stored."""
    path = os.pathsep.join(p for p in (str(AS_STORED_PATH), os.environ.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def shared(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    secret = {"TRANSPORT_SECRET": uuid.uuid4().hex}
    logs = tmp_path_factory.mktemp("tp2-server")
    # the trainer child imports while the server starts
    with (
        HttpTrainer("trainer", env=secret, wait=False) as trainer,
        VllmServer(model_dir, logs / "server-1.log", tp=TP, env=as_stored(secret)) as server,
    ):
        trainer.started(120)
        yield Shared(server, trainer, secret)


def test_each_worker_takes_each_version_and_an_outsider_reaches_none(
    shared: Shared, model_dir: Path, redis_url: str, reference
):
    server, trainer = shared.server, shared.trainer
    assert server.generate() == reference(shared.version)
    namespace = f"vllm-{uuid.uuid4().hex[:8]}"
    trainer.call("connect", server.url, redis_url, namespace, {"timeout": 60}, timeout=120)
    for version in shared.next_versions(2):
        status, reasons = trainer.call("send", version, timeout=180)
        # one subscriber per tensor-parallel worker, each with the whole version
        assert len(status) == TP and set(status.values()) == {"done"}, reasons
        assert all("-r0" in n or "-r1" in n for n in status), status
        assert server.get("weight_info") == {"weight_version": str(version)}
        assert server.generate() == reference(version), f"version {version}"
        shared.version = version
    # an outsider (the store and the hosts, no secret) cannot reach the workers
    with LlamaPublisher(
        "outsider", redis_url, model_dir, namespace=namespace, timeout=10
    ) as outsider:
        status, reasons = outsider.call("publish", 99, 10.0)
    # the group's entries are signed: it cannot even learn who subscribes
    assert status == {}, (status, reasons)
    assert server.generate() == reference(shared.version)


def test_a_sharded_trainer_writes_each_tp_worker_only_the_intersection(
    shared: Shared, model_dir: Path, redis_url: str, reference
):
    """Two trainer ranks holding tensor-parallel shards (column-parallel along dim 0, row-
    parallel along dim 1, norms replicated), two vLLM workers: rank r's shards are worker r's
    slices, so each rank writes its own worker everything but part of the replicated tensors
    (dealt round robin over the ranks) and the other worker only its share of those."""
    server, secret = shared.server, shared.secret["TRANSPORT_SECRET"]
    assert server.generate() == reference(shared.version)
    want, replicated = kept_bytes("llama")
    group = f"tp2-sharded-{uuid.uuid4().hex[:8]}"
    ranks = [
        ShardedLlamaRank(f"rank-{r}", redis_url, model_dir, group, 2, r, wait=False, secret=secret)
        for r in range(2)
    ]
    try:
        for r in ranks:
            r.started(60)
        server.post(
            "init_weight_transfer_engine",
            {"init_info": {"store": redis_url, "group": group, "timeout": 60}},
        )
        workers = [s["peer"] for s in server.transport_state()]
        assert all(w.endswith(f"-r{k}") for k, w in enumerate(workers)), workers
        before = [r.call("traffic") for r in ranks]
        for version in shared.next_versions(2):
            for r in ranks:
                r.begin("publish", version, 60.0)
            for r in ranks:
                status, reasons = r.end("publish", 120)
                assert set(status.values()) == {"done"} and len(status) == TP, reasons
            after = [r.call("traffic") for r in ranks]
            sent = [[after[r].get(w, 0) - before[r].get(w, 0) for w in workers] for r in range(2)]
            before = after
            for k in range(TP):
                assert sent[0][k] + sent[1][k] == want, sent  # every byte once
                assert sent[1 - k][k] <= replicated, sent  # the other rank: replicated only
            server.post("start_weight_update")
            server.post("update_weights", {"update_info": {"version": version}})
            server.post("finish_weight_update", {"weight_version": str(version)})
            server.post("reset_prefix_cache")  # the KV values of the old weights
            assert server.generate() == reference(version), f"version {version}"
            shared.version = version
    finally:
        for r in ranks:
            r.stop()


@pytest.mark.delta
def test_delta_versions_carry_only_the_changes_of_each_workers_slice(
    shared: Shared, redis_url: str, reference
):
    """The trainer engine with ``delta=True``: the workers are told to keep an inbox, and from
    the second version on each receives only the changes in its own slice (a step sets 2% of
    the elements anew), applied onto the version it holds; the server then says exactly what
    transformers says on the same weights, as after a whole version."""
    server, trainer = shared.server, shared.trainer
    assert server.generate() == reference(shared.version)
    namespace = f"vllm-delta-{uuid.uuid4().hex[:8]}"
    init = {"timeout": 60, "delta": True}
    trainer.call("connect", server.url, redis_url, namespace, init, timeout=120)
    want, _ = kept_bytes("llama")
    first = max(STEPS, shared.version + 1)
    for version in range(first, first + 3):
        status, reasons = trainer.call("send", version, timeout=180)
        assert len(status) == TP and set(status.values()) == {"done"}, reasons
        patched = trainer.call("patched")
        if version == first:  # nothing to apply changes onto yet
            assert patched == {}, patched
        else:  # each worker: the changes of its slice, a small part of it
            assert set(patched) == set(status), patched
            assert all(0 < n < want // 5 for n in patched.values()), (patched, want)
        assert server.generate() == reference(version), f"version {version}"
        shared.version = version
    assert reference(first) != reference(first + 2)  # the steps change what the model says


@pytest.mark.parametrize(("asked", "mode"), [("auto", "inplace"), ("streamed", "streamed")])
def test_tp_workers_with_no_room_for_a_copy_receive_their_slices_inside_finish(
    asked: str, mode: str, shared: Shared, redis_url: str, reference
):
    """Room for half a copy of a worker's slice: a server that computes with its parameters as
    stored takes each version straight into them (the automatic choice), or streamed through
    two buckets when asked (what vLLM's CPU build chooses, test_vllm_streamed.py); both inside
    vLLM's finish call, each worker only its slice, and nothing written while vLLM serves."""
    server = shared.server
    assert server.generate() == reference(shared.version)
    want, _ = kept_bytes("llama")
    bound = want // 2
    namespace = f"tp2-{mode}-{uuid.uuid4().hex[:8]}"
    with HttpTrainer(f"trainer-{mode}", env=shared.secret) as trainer:
        info = {"timeout": 60, "staging_gb": bound / 2**30, "mode": asked}
        trainer.call("connect", server.url, redis_url, namespace, info, timeout=120)
        states = server.transport_state()
        assert [s["mode"] for s in states] == [mode] * TP, states
        for s in states:  # in place none; streamed two buckets within the bound
            if mode == "inplace":
                assert s["staging_bytes"] == 0 and s["parts"] <= 2, s
            else:
                assert 0 < s["staging_bytes"] <= bound and s["parts"] > 2, s
        for version in shared.next_versions(3):
            status, reasons, sent = send_counting(trainer, version)
            assert len(status) == TP and set(status.values()) == {"done"}, reasons
            assert sent == dict.fromkeys(status, want), (sent, want)  # every part, counted
            assert server.get("weight_info") == {"weight_version": str(version)}
            assert [s["version"] for s in server.transport_state()] == [version] * TP
            assert server.generate() == reference(version), f"version {version}"
            shared.version = version
        # a publish while vLLM serves is never credited: it excludes both workers at its
        # deadline, and vLLM serves what it had whole
        status, _ = trainer.call("publish", shared.version + 1, 3.0, timeout=120)
        assert set(status.values()) == {"excluded"} and len(status) == TP, status
        assert server.generate() == reference(shared.version)


def test_a_restarted_server_rejoins(
    shared: Shared, model_dir: Path, redis_url: str, reference, tmp_path: Path
):
    """The server is killed; a new one (one worker) at the same address, the trainer's client
    knows no other: the trainer engine's next update reaches it, and the killed workers are
    reported, not waited on for ever. Last in this file: the module's server is gone after."""
    server, trainer = shared.server, shared.trainer
    namespace = f"vllm-rejoin-{uuid.uuid4().hex[:8]}"
    trainer.call("connect", server.url, redis_url, namespace, {"timeout": 60}, timeout=120)
    version = shared.version + 1
    status, reasons = trainer.call("send", version, timeout=180)
    assert len(status) == TP and set(status.values()) == {"done"}, reasons
    first_workers = set(status)
    server.kill()

    with VllmServer(
        model_dir, tmp_path / "server-2.log", port=server.port, env=as_stored(shared.secret)
    ) as again:
        assert again.generate() == reference(0)  # it starts from its checkpoint
        status, reasons = trainer.call("send", version + 1, timeout=180)
        new = [n for n, s in status.items() if s == "done"]
        assert len(new) == 1 and new[0] not in first_workers, (status, reasons)
        assert {n for n, s in status.items() if s != "done"} <= first_workers
        assert again.get("weight_info") == {"weight_version": str(version + 1)}
        assert again.generate() == reference(version + 1)
