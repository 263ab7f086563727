"""The update sequence that the tensor-parallel server tests run against a vLLM server of two
workers (tests/integrations/vllm/test_vllm_tp2.py, test_vllm_moe_tp2.py): a trainer connected with a
staging bound, three versions with each worker's bytes counted and vLLM's tokens compared with
transformers', then a trainer that dies between vLLM's update and finish calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helpers.llama import kept_bytes
from helpers.vllm_peers import send_counting

TP = 2


@dataclass
class Updates:
    """What one run of :func:`run_updates` needs: the model ``kind`` the server serves, the
    staging bound and how many copies of a worker's slice it leaves room for, the store and
    the namespace the trainer connects with, the version the server serves now (the run
    publishes the five after it), and, across hosts, the bytes the trainer's link has sent."""

    kind: str
    slots: int
    staging_gb: float
    store: str
    namespace: str
    served: int = 0
    link_sent: Callable[[], int] | None = None


def staging_for(kind: str, slots: int) -> float:
    """A staging bound (GB) with room for ``slots`` copies of a worker's slice and half of one."""
    want, _ = kept_bytes(kind)
    return (slots + 0.5) * want / 2**30


def run_updates(trainer: Any, server: Any, run: Updates, reference: Any) -> int:
    """Three updates, each worker's bytes and (across hosts) the trainer's link counted; then a
    trainer that dies between vLLM's update and finish calls. Returns the version served at
    the end."""
    kind = run.kind
    want, _ = kept_bytes(kind)
    v = run.served
    assert server.generate() == reference(v, kind=kind)
    trainer.started(120)
    info = {"timeout": 60, "staging_gb": run.staging_gb}
    trainer.call("connect", server.url, run.store, run.namespace, info, kind, timeout=120)
    states = server.transport_state()
    assert [s["mode"] for s in states] == ["sharded"] * TP, states
    assert all(s["fallback"] == {} for s in states), states
    assert [s["version_bytes"] for s in states] == [want] * TP
    assert [s["staging_slots"] for s in states] == [run.slots] * TP
    for s in states:  # copies of its slice, counted from its buffers; within the bound
        assert run.slots * want <= s["staging_bytes"] <= run.staging_gb * 2**30, s
    for version in (v + 1, v + 2, v + 3):
        before = run.link_sent() if run.link_sent else 0
        status, reasons, sent = send_counting(trainer, version)
        assert len(status) == TP and set(status.values()) == {"done"}, reasons
        assert sent == dict.fromkeys(status, want), (sent, want)
        if run.link_sent is not None:  # what the trainer wrote crossed its link, once
            link = run.link_sent() - before
            print(f"\nversion {version}: the trainer's link sent {link} bytes")
            assert TP * want <= link < 1.1 * TP * want + (1 << 20), link
        assert server.get("weight_info") == {"weight_version": str(version)}
        assert server.generate() == reference(version, kind=kind), f"version {version}"

    # a trainer that dies between vLLM's update and finish calls (played here over HTTP)
    trainer.call("publish", v + 4, timeout=120)
    server.post("start_weight_update")
    server.post("update_weights", {"update_info": {"version": v + 4}})
    assert {s["held"] for s in server.transport_state()} == {v + 4}
    assert server.get("weight_info") == {"weight_version": str(v + 3)}
    assert server.generate() == reference(v + 3, kind=kind)  # serves what it reports
    # the trainer engine's next send closes the open update (loading nothing), then goes on
    status, reasons = trainer.call("send", v + 5, timeout=180)
    assert set(status.values()) == {"done"}, reasons
    assert server.get("weight_info") == {"weight_version": str(v + 5)}
    assert server.generate() == reference(v + 5, kind=kind)
    return v + 5
