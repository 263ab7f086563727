"""vLLM's HTTP server with two tensor-parallel workers (separate processes) takes each version as
each worker keeps it: its own slice of every column- and row-parallel weight, its part of the
fused q/k/v and gate/up, whole copies of what every rank holds (norms; the key/value heads of a
model with fewer of them than ranks). The bytes the trainer wrote to each worker are counted
(``Transport.traffic``, as transfers complete) and compared with what the model's shapes say a
worker keeps, computed here from the checkpoint and the rules of tensor parallelism, not from
the library's layout. After each of three updates vLLM's greedy tokens equal transformers'
(helpers/tp2_updates.py; a tied mixture of experts runs the same in test_vllm_moe_tp2.py).

The Llama's server runs on another host (marker ``hosts``, where namespaces can be made): a
cluster on this machine (transport/cluster/) puts the server in one host, the trainer in a
second and Redis in a third, UCX kept to TCP over the links, and the trainer's link is counted
per update: it carries what the trainer wrote, once."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers.llama import hf_model, kept_bytes
from helpers.netns import Within, inside
from helpers.tp2_updates import TP, Updates, run_updates, staging_for
from helpers.vllm_peers import HttpTrainer
from helpers.vllm_server import VllmServer
from transport import ClusterError
from transport.cluster import Cluster, Link, check_rights

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600), pytest.mark.slow]

#: what every process of a cluster runs with: UCX and gloo on the host's link, and progress made
#: by the engines' polls. With UCX kept to TCP, ``auto`` would pick NIXL's progress thread; in
#: two vLLM workers bound to one core each, that thread was seen (in one full run of the suite
#: out of two) to spin in poll() for two minutes after the workers joined, holding both cores of
#: the machine and starving the tests beside it. What this file checks is which bytes reach each
#: worker, not how a receiver wakes.
NET = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
    "TRANSPORT_PROGRESS": "poll",
}


@dataclass
class Place:
    """Where the test's parts run: the store, the trainer's and the server's network namespaces
    (None: this one), the server's address, and the cluster whose links are counted, if any."""

    store: str
    trainer: str | None = None
    server: str | None = None
    address: str = "127.0.0.1"
    cluster: Cluster | None = None

    def link_sent(self) -> Callable[[], int] | None:
        """What counts the bytes the trainer's link has sent (None: no cluster, no link)."""
        cluster = self.cluster
        if cluster is None:
            return None
        return lambda: cluster.traffic()["trainer"].sent


@contextmanager
def placed(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Place]:
    """Across three hosts of a cluster where namespaces can be made; else on this host."""
    try:
        check_rights()
    except ClusterError:
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


@pytest.mark.hosts
def test_each_tp_worker_receives_only_its_slice(
    model_dir: Path,
    redis_url: str,
    reference,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """The staging bound leaves room for two copies of a worker's slice: each worker keeps two
    slots. (A tied model with room for one: test_vllm_moe_tp2.py.)"""
    with placed(redis_url, monkeypatch) as at:
        namespace = f"tp2-{uuid.uuid4().hex[:8]}"
        staging = staging_for("llama", 2)
        run = Updates("llama", 2, staging, at.store, namespace, link_sent=at.link_sent())
        with inside(at.trainer):  # the trainer imports while the server starts
            trainer = HttpTrainer("trainer", env=NET if at.cluster else {}, wait=False)
        with trainer:
            with inside(at.server):
                server = VllmServer(model_dir, tmp_path / "server.log", tp=TP, host=at.address)
            with server:
                run_updates(trainer, Within(server, at.server), run, reference)


def test_kept_bytes_follows_the_shapes():
    """The reference above: half of every split tensor, norms whole (the small Llama: 2 key/
    value heads split over 2 ranks; the tied Qwen2: 1 key/value head, whole on each rank)."""
    llama, llama_rep = kept_bytes("llama")
    qwen, qwen_rep = kept_bytes("qwen2-tied")
    full = sum(t.numel() * 4 for t in hf_model(0).parameters())  # type: ignore[attr-defined]
    assert llama == (full - llama_rep) // 2 + llama_rep
    assert qwen_rep > llama_rep  # k and v (and their biases) whole on both ranks
    assert torch.float32.itemsize == 4
