"""vLLM's HTTP server with two tensor-parallel workers (separate processes) takes each version as
each worker keeps it: its own slice of every column- and row-parallel weight, its part of the
fused q/k/v and gate/up, whole copies of what every rank holds (norms; the key/value heads of a
model with fewer of them than ranks). The bytes the trainer wrote to each worker are counted
(``Transport.traffic``, as transfers complete) and compared with what the model's shapes say a
worker keeps, computed here from the checkpoint and the rules of tensor parallelism, not from
the library's layout. After each of three updates vLLM's greedy tokens equal transformers'.

The Llama's server runs on another host (marker ``hosts``, where namespaces can be made): a
cluster on this machine (transport/cluster/) puts the server in one host, the trainer in a
second and Redis in a third, UCX kept to TCP over the links, and the trainer's link is counted
per update: it carries what the trainer wrote, once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.llama import hf_model, kept_bytes
from helpers.netns import Within, inside
from helpers.vllm_peers import HttpTrainer, send_counting
from helpers.vllm_server import VllmServer
from transport.cluster import Cluster, ClusterError, Link, check_rights

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

TP = 2
#: what every process of a cluster runs with: UCX and gloo on the host's link
NET = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}


@dataclass
class Place:
    """Where the test's parts run: the store, the trainer's and the server's network namespaces
    (None: this one), the server's address, and the cluster whose links are counted, if any."""

    store: str
    trainer: str | None = None
    server: str | None = None
    address: str = "127.0.0.1"
    cluster: Cluster | None = None

    def trainer_sent(self) -> int:
        return self.cluster.traffic()["trainer"].sent if self.cluster is not None else 0


@contextmanager
def placed(across: bool, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    """On this host, or across three hosts of a cluster where namespaces can be made."""
    try:
        if across:
            check_rights()
    except ClusterError:
        across = False
    if not across:
        yield Place(redis_url)
        return
    for k, v in NET.items():  # the children inherit it
        monkeypatch.setenv(k, v)
    with Cluster(1, Link.parse("10gbit")) as cluster:
        host = cluster.generator(0)
        yield Place(
            cluster.start_store("redis"),
            cluster.trainer.namespace,
            host.namespace,
            host.address,
            cluster,
        )


@pytest.mark.parametrize(
    ("kind", "slots", "across"),
    [pytest.param("llama", 2, True, marks=pytest.mark.hosts), ("qwen2-tied", 1, False)],
)
def test_each_tp_worker_receives_only_its_slice(
    kind: str,
    slots: int,
    across: bool,
    model_dir_of,
    redis_url: str,
    reference,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """The staging bound lets two copies of a worker's slice fit for the Llama, one for the
    Qwen2: each worker chooses the slots from it."""
    folder = model_dir_of(kind)
    want, _ = kept_bytes(kind)
    staging_gb = (slots + 0.5) * want / 2**30
    namespace = f"tp2-{uuid.uuid4().hex[:8]}"
    with placed(across, redis_url, monkeypatch) as at:
        with inside(at.trainer):  # the trainer imports while the server starts
            trainer = HttpTrainer("trainer", env=NET if at.cluster else {}, wait=False)
        with trainer:
            with inside(at.server):
                server = VllmServer(folder, tmp_path / "server.log", tp=TP, host=at.address)
            with server:
                run_updates(
                    trainer,
                    Within(server, at.server),
                    at,
                    kind,
                    slots,
                    staging_gb,
                    namespace,
                    reference,
                )


def run_updates(
    trainer: Any,
    server: Any,
    at: Place,
    kind: str,
    slots: int,
    staging_gb: float,
    namespace: str,
    reference: Any,
) -> None:
    """Three updates, each worker's bytes and (across hosts) the trainer's link counted; then a
    trainer that dies between vLLM's update and finish calls."""
    want, _ = kept_bytes(kind)
    assert server.generate() == reference(0, kind=kind)
    trainer.started(120)
    info = {"timeout": 60, "staging_gb": staging_gb}
    trainer.call("connect", server.url, at.store, namespace, info, kind, timeout=120)
    states = server.transport_state()
    assert [s["mode"] for s in states] == ["sharded"] * TP, states
    assert all(s["fallback"] == {} for s in states), states
    assert [s["version_bytes"] for s in states] == [want] * TP
    assert [s["staging_slots"] for s in states] == [slots] * TP
    for s in states:  # copies of its slice, counted from its buffers; within the bound
        assert slots * want <= s["staging_bytes"] <= staging_gb * 2**30, s
    for version in (1, 2, 3):
        before = at.trainer_sent()
        status, reasons, sent = send_counting(trainer, version)
        link = at.trainer_sent() - before
        assert len(status) == TP and set(status.values()) == {"done"}, reasons
        assert sent == dict.fromkeys(status, want), (sent, want)
        if at.cluster is not None:  # what the trainer wrote crossed its link, once
            print(f"\nversion {version}: the trainer's link sent {link} bytes")
            assert TP * want <= link < 1.1 * TP * want + (1 << 20), link
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


def test_kept_bytes_follows_the_shapes():
    """The reference above: half of every split tensor, norms whole (the small Llama: 2 key/
    value heads split over 2 ranks; the tied Qwen2: 1 key/value head, whole on each rank)."""
    llama, llama_rep = kept_bytes("llama")
    qwen, qwen_rep = kept_bytes("qwen2-tied")
    full = sum(t.numel() * 4 for t in hf_model(0).parameters())  # type: ignore[attr-defined]
    assert llama == (full - llama_rep) // 2 + llama_rep
    assert qwen_rep > llama_rep  # k and v (and their biases) whole on both ranks
    assert torch.float32.itemsize == 4
