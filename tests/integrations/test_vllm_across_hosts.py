"""vLLM's HTTP server on another host: a cluster on this machine (transport/cluster/) puts the
server (two tensor-parallel workers) in one host, the trainer in a second and Redis in a third,
UCX kept to TCP over the links. Three updates through vLLM's own trainer factory and HTTP
client: each lands whole in both workers, the server's greedy tokens equal transformers', and
the trainer's link carries what the trainer wrote, once (each worker its own shard), as its
interface counts it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.llama import kept_bytes
from helpers.netns import entered
from helpers.vllm_peers import HttpTrainer, send_counting
from helpers.vllm_server import VllmServer
from transport.cluster import Cluster, ClusterError, Link, check_rights

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600), pytest.mark.slow]

#: what every process of the cluster runs with: UCX and gloo on the host's link
NET = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}


def test_a_tp2_server_on_another_host_takes_three_updates_over_the_link(
    model_dir: Path, reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    try:
        check_rights()
    except ClusterError as e:
        pytest.skip(str(e))
    for k, v in NET.items():  # the children inherit it
        monkeypatch.setenv(k, v)
    kept, _ = kept_bytes("llama")
    with Cluster(1, Link.parse("10gbit")) as cluster:
        store = cluster.start_store("redis")
        host = cluster.generator(0)
        with entered(cluster.trainer.namespace):  # the trainer imports while the server starts
            trainer = HttpTrainer("trainer", env=NET, wait=False)
        with trainer:
            with entered(host.namespace):
                server = VllmServer(model_dir, tmp_path / "server.log", tp=2, host=host.address)
            with server:
                with entered(host.namespace):
                    assert server.generate() == reference(0)
                trainer.started(120)
                trainer.call("connect", server.url, store, f"vllm-{uuid.uuid4().hex[:8]}",
                             {"timeout": 60}, timeout=120)  # fmt: skip
                for version in (1, 2, 3):
                    before = cluster.traffic()["trainer"]
                    status, reasons, wrote = send_counting(trainer, version)
                    sent = cluster.traffic()["trainer"].sent - before.sent
                    print(f"\nversion {version}: trainer's link sent {sent / 2**20:.1f} MiB, "
                          f"wrote {sorted(wrote.values())} bytes to the workers")  # fmt: skip
                    assert len(status) == 2 and set(status.values()) == {"done"}, reasons
                    assert sorted(wrote.values()) == [kept, kept]  # each worker: its shard
                    with entered(host.namespace):
                        assert server.get("weight_info") == {"weight_version": str(version)}
                        assert server.generate() == reference(version), f"version {version}"
                    # what the trainer wrote crossed its link, once (framing and control aside)
                    assert 2 * kept <= sent < 1.1 * 2 * kept + (1 << 20), sent
