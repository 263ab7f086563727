"""The trainer engine reads each worker's signed update mark before it sends: an update a dead
trainer left open is closed first, and where a worker says its model is torn (in place or
streamed, a trainer killed mid-write) vLLM is told to report the weight version ``torn:V``
until a version loads whole. A mark another peer wrote, or an unsigned one, changes nothing.
vLLM's side is a client that records what it is asked (the real engine's side of the marks is
tested in test_vllm_inplace.py and test_vllm_streamed.py); the store, the Transports, the
group and the signatures are real."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import transport

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


class Recorder:
    """vLLM's weight-sync client protocol, recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", None))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset", None))


def _sent(client: Recorder, version: int) -> list[tuple[str, Any]]:
    return [
        ("init", None),
        ("start", None),
        ("update", {"version": version, "timeout": 30}),
        ("finish", str(version)),
        ("reset", None),
    ]


@pytest.mark.parametrize("mark", ["torn", "open", "forged", "closed"])
def test_a_trainer_closes_what_its_predecessor_left_and_names_a_torn_model(store, mark):
    # imported here, not when each pytest worker collects this file: they import vLLM
    from transport.integrations.vllm.infos import torn_mark, update_key
    from transport.integrations.vllm.trainer import TransportTrainer, TransportTrainerInitInfo

    group = f"marks-{mark}"
    client = Recorder()
    with (
        transport.Transport("vllm-worker", store=store.url, timeout=30) as worker,
        transport.Transport("outsider", store=store.url, timeout=30) as outsider,
    ):
        sub = transport.WeightSubscriber(worker, {"w": torch.zeros(1024)}, group=group)
        key = update_key("default", group, worker.name)
        if mark == "torn":  # a trainer died mid-write: the worker's own mark
            worker.core.signed.set(key, torn_mark(7))
        elif mark == "open":  # a trainer died between vLLM's update and finish calls
            worker.core.signed.set(key, b"open")
        elif mark == "forged":  # another peer of the namespace writes the worker's key
            outsider.core.signed.set(key, torn_mark(7))
        else:
            worker.core.signed.set(key, b"closed")
        info = TransportTrainerInitInfo(store.url, group=group, name="trainer", timeout=30, rank=0)
        engine = TransportTrainer.trainer_init(
            info, client=client, source={"w": torch.full((1024,), 8.0)}
        )
        try:
            result = engine.send_weights(8)
            assert result is not None and result.status == {"vllm-worker": "done"}
        finally:
            engine.shutdown()
        with sub.read(8, timeout=10) as snap:  # the version arrived, every byte
            assert torch.equal(snap.tensors["w"], torch.full((1024,), 8.0))
        sub.close()
    closing = {
        "torn": [("update", {"abandon": True}), ("finish", "torn:7")],
        "open": [("update", {"abandon": True}), ("finish", None)],
        "forged": [],
        "closed": [],
    }[mark]
    sent = _sent(client, 8)
    assert client.calls == [sent[0], ("init", None), *closing, *sent[1:]], client.calls
