"""vLLM workers that receive in place: each version written straight into the parameters vLLM
computes with, only inside ``finish_weight_update``, with no staging memory.

vLLM's CPU build computes its linear layers with a packed oneDNN copy of each weight, so there a
worker refuses to write in place (test_vllm_offline.py checks the refusal). These engines are
made to compute with their parameters as stored, as vLLM's GPU builds do
(helpers.vllm_peers.compute_as_stored): the real engine, the real loader and model otherwise.
After each update, vLLM's greedy tokens equal transformers' on the same weights."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.child import ChildError
from helpers.vllm_peers import (
    LlamaPublisher,
    ShardedTrainer,
    VllmProcess,
    init_info,
    send_on_both_ranks,
)
from transport.store.tcp import TcpStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.slow]

#: far less than one staging copy of the test model: "auto" must choose to write in place
TINY_GB = 1e-4


@pytest.fixture(scope="module")
def vllm(model_dir: Path) -> Iterator[VllmProcess]:
    with VllmProcess("vllm-inplace", model_dir, as_stored=True) as child:
        yield child


def _info(store: TcpStore, group: str) -> dict[str, object]:
    return init_info(store.url, group, staging_gb=TINY_GB)


def _publish_and_update(vllm: VllmProcess, trainer: LlamaPublisher, version: int) -> str:
    """Publish ``version`` and drive vLLM's update while it is on its way (the worker is
    written inside its finish); returns the weight version vLLM reports."""
    trainer.begin("publish", version, 30.0)
    try:
        reported = vllm.call("update", {"version": version, "timeout": 30})
    finally:
        status, reasons = trainer.end("publish", 90)
    assert set(status.values()) == {"done"}, reasons
    return reported


def test_auto_writes_in_place_when_no_staging_copy_fits(vllm, store, reference, model_dir):
    vllm.call("init", _info(store, "inplace"))
    (state,) = vllm.call("engine_state")
    assert state["mode"] == "inplace"
    assert (state["staging_slots"], state["staging_bytes"]) == (0, 0)
    with LlamaPublisher("trainer", store.url, model_dir, group="inplace") as trainer:
        for version in (1, 2, 3):
            assert _publish_and_update(vllm, trainer, version) == str(version)
            assert vllm.call("generate") == reference(version), f"version {version}"
            assert vllm.call("engine_state")[0]["version"] == version
        # outside an update nothing is written: a version published while vLLM serves is
        # never credited a slot and is excluded at its deadline; vLLM serves version 3 still
        status, reasons = trainer.call("publish", 4, 2.0)
        assert set(status.values()) == {"excluded"}, reasons
        assert vllm.call("generate") == reference(3)
        assert vllm.call("engine_state")[0]["version"] == 3


def test_a_tied_model_in_place(store, reference, model_dir_of):
    """Qwen2 with tied embeddings, q/k/v biases and grouped-query attention: the output head
    is the embedding, written once."""
    qwen = model_dir_of("qwen2-tied")
    with VllmProcess("vllm-qwen-inplace", qwen, as_stored=True) as vllm:
        vllm.call("init", {**_info(store, "tied-inplace"), "mode": "inplace"})
        assert vllm.call("engine_state")[0]["mode"] == "inplace"
        with LlamaPublisher("trainer", store.url, qwen, group="tied-inplace") as trainer:
            for version in (1, 2):
                assert _publish_and_update(vllm, trainer, version) == str(version)
                assert vllm.call("generate") == reference(version, kind="qwen2-tied")


def test_a_trainer_killed_mid_write_leaves_a_model_named_torn_and_the_next_version_whole(
    vllm, store, reference, model_dir
):
    """In place, writing is not atomic: a trainer that dies mid-version leaves parts of two
    versions in the model. The finish fails saying so, the worker reports -2 (torn), and the
    next version, written whole, makes the model whole again."""
    group = "inplace-torn"
    vllm.call("init", {**_info(store, group), "mode": "inplace"})
    first = LlamaPublisher("trainer", store.url, model_dir, group=group, inline_bytes=0)
    try:
        assert _publish_and_update(vllm, first, 1) == "1"
        # version 2's bytes go into the model, its completion never does; the trainer dies
        first.call("hold_notified_parts")
        first.call("publish_nowait", 2, 30.0)
        vllm.call("start")
        vllm.call("update_only", {"version": 2, "timeout": 15})
        with pytest.raises(
            ChildError, match="did not complete in place .* parts of versions 2 and 1"
        ):
            vllm.call("finish", "2")
        # vLLM keeps the update open; the worker's signed mark tells the next trainer the model
        # is torn (it finishes the update with the weight version "torn:2")
        assert _update_mark(store, group, vllm) == b"torn:2"
        vllm.call("finish", None)  # as a framework driving vLLM by hand closes it
        first.kill()
        assert first.proc.exitcode == -signal.SIGKILL
    finally:
        first.stop()
    assert vllm.call("engine_state")[0]["version"] == -2
    with LlamaPublisher("trainer", store.url, model_dir, group=group) as second:
        assert _publish_and_update(vllm, second, 3) == "3"
        assert vllm.call("generate") == reference(3)
        assert vllm.call("engine_state")[0]["version"] == 3


def _update_mark(store: TcpStore, group: str, vllm: VllmProcess) -> bytes | None:
    """The worker's update mark (infos.update_key), read as a trainer reads it: signed by it."""
    import transport
    from transport.integrations.vllm.infos import update_key

    (state,) = vllm.call("engine_state")
    key = update_key("default", group, state["peer"])
    with transport.Transport("mark-reader", store=store.url, timeout=30) as t:
        value = t.core.signed.read(key, "the update mark", writer=state["peer"])
    return None if value is None else value.body


def test_the_trainer_engine_drives_workers_in_place_from_a_sharded_trainer(
    store, reference, model_dir
):
    """vLLM's own trainer API, two ranks each holding half of every tensor: the engine learns
    from the store that the worker writes in place and publishes while it drives the update."""
    with (
        ShardedTrainer(
            "trainer", store.url, model_dir, 2, 0, as_stored=True, mode="inplace"
        ) as rank0,
        ShardedTrainer("trainer", store.url, model_dir, 2, 1, mode="inplace") as rank1,
    ):
        for version in (1, 2):
            status, tokens = send_on_both_ranks(rank0, rank1, version)
            assert len(status) == 1 and set(status.values()) == {"done"}, status
            assert tokens == reference(version), f"version {version}"
        (state,) = rank0.call("engine_state")
        assert (state["mode"], state["version"], state["staging_bytes"]) == ("inplace", 2, 0)
