"""vLLM (the real engine, CPU build, offline ``LLM``) receives weights through the ``transport``
backend from a trainer in another process that publishes as one rank holding every tensor
(each worker takes only what it keeps), or with a plain WeightPublisher (the whole mode). After
each update vLLM's greedy tokens equal transformers' on the same weights (float32): every
tensor arrived, was fused and loaded. The faults: a trainer killed mid-publish, a version that
never comes, a store nobody hosts, a trainer of another model; in each, vLLM keeps serving the
weights it had."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers.child import ChildError
from helpers.llama import hf_model
from helpers.polling import wait_until
from helpers.processes import free_port
from helpers.vllm_peers import (
    LlamaPublisher,
    ShardedLlamaRank,
    ShardedTrainer,
    VllmProcess,
    init_info,
    send_on_both_ranks,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm(model_dir: Path) -> Iterator[VllmProcess]:
    with VllmProcess("vllm", model_dir) as child:
        yield child


def _worker(vllm: VllmProcess) -> str:
    (state,) = vllm.call("engine_state")
    return state["name"]


def test_each_update_serves_exactly_the_version_published(vllm, store, reference, model_dir):
    assert vllm.call("generate") == reference(0)  # the checkpoint it started from
    vllm.call("init", init_info(store.url, "exact"))
    with LlamaPublisher("trainer", store.url, model_dir, group="exact") as trainer:
        for version in (1, 2, 3):
            status, reasons = trainer.call("publish", version, 30.0)
            assert status == {_worker(vllm): "done"}, reasons
            assert vllm.call("update", {"version": version}) == str(version)
            assert vllm.call("generate") == reference(version), f"version {version}"
        # a version published but not loaded changes nothing vLLM serves (it was read from a
        # staging slot, which the publisher writes again now)
        status, _ = trainer.call("publish", 4, 30.0)
        assert status == {_worker(vllm): "done"}
        assert vllm.call("generate") == reference(3)
        assert vllm.call("engine_state")[0]["loaded"] == 3
        # no version named: the newest complete one (the worker may note 4 complete a moment
        # after the publisher saw it land)
        wait_until(lambda: vllm.call("engine_state")[0]["complete"] == 4, 30, "version 4 noted")
        vllm.call("update", {})
        assert vllm.call("generate") == reference(4)
        assert vllm.call("engine_state")[0]["loaded"] == 4
        # a version asked for by number that a newer one replaced in both slots
        for version in (5, 6):
            trainer.call("publish", version, 30.0)
        with pytest.raises(ChildError, match="VersionGoneError: version 4 .* no longer held"):
            vllm.call("update", {"version": 4})
        assert vllm.call("generate") == reference(4)


def test_a_sharded_trainer_of_two_ranks_updates_vllm(vllm, store, reference, model_dir):
    """Each rank writes only its tensor-parallel shards of the checkpoint tensors into the
    worker's staging memory; vLLM loads a version once both ranks' parts landed."""
    vllm.call("init", init_info(store.url, "sharded"))
    ranks = [
        ShardedLlamaRank(f"rank-{r}", store.url, model_dir, "sharded", 2, r, wait=False)
        for r in range(2)
    ]
    try:
        for r in ranks:
            r.started(60)
        for version in (1, 2):
            for r in ranks:
                r.begin("publish", version, 30.0)  # both ranks at once
            for r in ranks:
                status, reasons = r.end("publish", 90)
                assert status == {_worker(vllm): "done"}, reasons
            assert vllm.call("update", {"version": version}) == str(version)
            assert vllm.call("generate") == reference(version), f"version {version}"
    finally:
        for r in ranks:
            r.stop()


def test_vllms_trainer_factory_drives_a_sharded_trainer(store, reference, model_dir):
    """vLLM's own trainer API with a source layout: every rank publishes its shards through the
    ``transport`` trainer engine, rank 0 (which hosts the engine here) drives each update."""
    with (
        ShardedTrainer("trainer", store.url, model_dir, 2, 0) as rank0,
        ShardedTrainer("trainer", store.url, model_dir, 2, 1) as rank1,
    ):
        for version in (1, 2):
            status, tokens = send_on_both_ranks(rank0, rank1, version)
            assert len(status) == 1 and set(status.values()) == {"done"}, status
            assert tokens == reference(version), f"version {version}"


@pytest.mark.parametrize(("mode", "slots"), [("sharded", 2), ("sharded", 1), ("whole", 2)])
def test_a_trainer_killed_mid_publish_leaves_the_last_version_and_the_next_one_loads(
    vllm, store, reference, model_dir, mode, slots
):
    """In every mode a version reaches the model only once complete in staging: a trainer
    that dies mid-publish leaves vLLM serving (and reporting) the version before. With one
    staging slot the dead trainer's bytes tore the slot, not the model, and the next version
    overwrites it whole."""
    group, plain = f"killed-{mode}-{slots}", mode == "whole"
    vllm.call("init", {**init_info(store.url, group), "mode": mode, "staging_slots": slots})
    (state,) = vllm.call("engine_state")
    assert (state["mode"], state["staging_slots"]) == (mode, slots)
    # every transfer posted by its engine thread (none inline), which the test holds below
    first = LlamaPublisher(
        "trainer", store.url, model_dir, group=group, inline_bytes=0, plain=plain
    )
    try:
        status, reasons = first.call("publish", 1, 30.0)
        assert status == {_worker(vllm): "done"}, reasons
        assert vllm.call("update", {"version": 1}) == "1"
        # version 2's bytes go, its completion never does; the trainer dies then
        first.call("hold_notified_parts")
        first.call("publish_nowait", 2, 30.0)
        wait_until(lambda: vllm.call("engine_state")[0]["incomplete"] == 2, 30, "version 2 began")
        first.kill()
        assert first.proc.exitcode == -signal.SIGKILL
    finally:
        first.stop()
    with pytest.raises(ChildError, match="version 2 .* began but did not complete"):
        vllm.call("update", {"version": 2, "timeout": 1})
    assert vllm.call("weight_version") == "1"
    assert vllm.call("generate") == reference(1)
    # the trainer restarts (a new incarnation of the same name) and goes on
    with LlamaPublisher("trainer", store.url, model_dir, group=group, plain=plain) as second:
        status, reasons = second.call("publish", 3, 30.0)
        assert status == {_worker(vllm): "done"}, reasons
        assert vllm.call("update", {"version": 3}) == "3"
        assert vllm.call("generate") == reference(3)


def test_a_trainer_that_dies_between_update_and_finish_leaves_vllm_reporting_what_it_serves(
    vllm, store, reference, model_dir
):
    """vLLM names the version it serves only at finish_weight_update: a version is held by
    the update call and loaded by the finish, so a trainer that dies between the two leaves
    vLLM serving the version it reports (an RL framework weighs samples by it). The next trainer
    finds the update open, drops what the dead one held, and goes on."""
    vllm.call("init", init_info(store.url, "unfinished"))
    with LlamaPublisher("trainer", store.url, model_dir, group="unfinished") as trainer:
        trainer.call("publish", 1, 30.0)
        assert vllm.call("update", {"version": 1}) == "1"
        trainer.call("publish", 2, 30.0)
        vllm.call("update_unfinished", {"version": 2})  # start, update; the trainer dies
        assert vllm.call("engine_state")[0]["held"] == 2
        assert vllm.call("weight_version") == "1"
        assert vllm.call("generate") == reference(1)  # what it reports, not version 2
        with pytest.raises(ChildError, match="already active"):
            vllm.call("start")
        vllm.call("update_only", {"abandon": True})  # what TransportTrainer does then
        vllm.call("finish", None)
        assert vllm.call("engine_state")[0]["held"] is None
        assert vllm.call("weight_version") == "1"
        assert vllm.call("generate") == reference(1)
        trainer.call("publish", 3, 30.0)
        assert vllm.call("update", {"version": 3}) == "3"
        assert vllm.call("generate") == reference(3)


def test_tensors_the_replay_cannot_map_travel_whole_through_vllms_loader(
    vllm, store, reference, model_dir
):
    """A checkpoint tensor the worker cannot map to its parameters (here: declared so) goes
    through vLLM's loader, whole, in the same reload as the parameters written directly; so does
    every tensor that fills a parameter with it (q and v fill qkv_proj with k). The versions are
    exact, and the worker names what travels whole."""
    vllm.call("fall_back", ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"])
    try:
        vllm.call("init", init_info(store.url, "fallback"))
        (state,) = vllm.call("engine_state")
    finally:
        vllm.call("fall_back", [])
    assert state["mode"] == "sharded"
    assert sorted(state["fallback"]) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.norm.weight",
    ], state["fallback"]
    assert "qkv_proj" in state["fallback"]["model.layers.0.self_attn.q_proj.weight"]
    with LlamaPublisher("trainer", store.url, model_dir, group="fallback") as trainer:
        for version in (1, 2):
            status, reasons = trainer.call("publish", version, 30.0)
            assert set(status.values()) == {"done"}, reasons
            assert vllm.call("update", {"version": version}) == str(version)
            assert vllm.call("generate") == reference(version), f"version {version}"


def test_an_update_with_no_version_fails_within_its_timeout_and_vllm_keeps_serving(
    vllm, store, reference, model_dir
):
    before = vllm.call("generate")
    version = vllm.call("weight_version")
    vllm.call("init", init_info(store.url, "nobody"))  # a group no trainer publishes to
    with pytest.raises(ChildError, match=r"TransferTimeout: version 1 .* within 0.5 s"):
        vllm.call("update", {"version": 1, "timeout": 0.5})
    with pytest.raises(ChildError, match=r"TransferTimeout: version 0 .* within 0.5 s"):
        vllm.call("update", {"timeout": 0.5})
    assert vllm.call("generate") == before and vllm.call("weight_version") == version
    # and the next update of a live trainer succeeds
    with LlamaPublisher("trainer", store.url, model_dir, group="nobody") as trainer:
        status, reasons = trainer.call("publish", 7, 30.0)
        assert status == {_worker(vllm): "done"}, reasons
        assert vllm.call("update", {"version": 7}) == "7"
        assert vllm.call("generate") == reference(7)


def test_a_trainer_publishing_bfloat16_feeds_a_float32_model(vllm, store, reference, model_dir):
    vllm.call(
        "init", {**init_info(store.url, "bf16"), "dtype": "bfloat16"}
    )  # what the trainer sends
    with LlamaPublisher(
        "trainer", store.url, model_dir, group="bf16", mangle="bfloat16"
    ) as trainer:
        status, reasons = trainer.call("publish", 8, 30.0)
        assert status == {_worker(vllm): "done"}, reasons
        assert vllm.call("update", {"version": 8}) == "8"
    # vLLM's loader converted on load: the float32 model holds the bfloat16-rounded weights
    norm = hf_model(8).state_dict()["model.norm.weight"]  # type: ignore[attr-defined]
    held = torch.tensor(vllm.call("param", "model.norm.weight"))
    assert held.dtype == torch.float32 and torch.equal(held, norm.to(torch.bfloat16).float())
    assert not torch.equal(held, norm)  # the rounding shows
    assert vllm.call("generate") == reference(8, through=torch.bfloat16)


@pytest.mark.parametrize("mangle", ["shape", "names"])
def test_a_trainer_of_another_model_is_refused_before_a_byte_moves(vllm, store, mangle, model_dir):
    before = vllm.call("generate")
    group = f"bad-{mangle}"
    vllm.call("init", init_info(store.url, group))
    with LlamaPublisher("trainer", store.url, model_dir, group=group, mangle=mangle) as trainer:
        status, reasons = trainer.call("publish", 1, 30.0)
        worker = _worker(vllm)
        assert status == {worker: "excluded"}
        # the publisher names the rule and the tensor
        assert "model.norm.weight" in reasons[worker], reasons
        with pytest.raises(ChildError, match="TransferTimeout: version 1"):
            vllm.call("update", {"version": 1, "timeout": 0.5})
    assert vllm.call("generate") == before


def test_an_init_into_another_group_frees_the_old_staging_first(vllm, store):
    """staging_gb bounds one group's staging: the old group's is freed before the new one's is
    allocated, not whenever Python's collector runs."""
    vllm.call("init", init_info(store.url, "first-group"))
    assert vllm.call(
        "reinit_frees_staging", {**init_info(store.url, "second-group"), "mode": "whole"}
    )
    assert vllm.call("engine_state")[0]["mode"] == "whole"


def test_bad_init_and_update_infos_are_refused_with_the_rule(vllm, store):
    before = vllm.call("generate")
    unreachable = f"redis://127.0.0.1:{free_port()}/0"  # a store nobody runs
    with pytest.raises(ChildError, match="StoreError: cannot reach store .* start the Redis"):
        vllm.call("init", {"store": unreachable, "group": "x", "timeout": 2})
    # it left the group it had: an update says what to do
    with pytest.raises(ChildError, match="was not initialized: call init_weight_transfer_engine"):
        vllm.call("update", {"timeout": 1})
    with pytest.raises(ChildError, match=r"unknown fields \['stroe'\]"):
        vllm.call("init", {"stroe": store.url})
    with pytest.raises(ChildError, match="dtype 'float33' is not a torch dtype"):
        vllm.call("init", {"store": store.url, "dtype": "float33"})
    with pytest.raises(ChildError, match="staging_device 'gpu9' is not a device"):
        vllm.call("init", {"store": store.url, "staging_device": "gpu9"})
    vllm.call("init", {**init_info(store.url, "infos"), "staging_device": "cpu"})
    assert vllm.call("engine_state")[0]["name"] is not None  # the failed inits left it as it was
    with pytest.raises(ChildError, match="version must be an int >= 0"):
        vllm.call("update", {"version": "latest"})
    with pytest.raises(ChildError, match="timeout must be > 0"):
        vllm.call("update", {"timeout": -1})
    assert vllm.call("generate") == before


def test_the_cpu_build_refuses_to_write_in_place_and_says_why(vllm, store):
    """vLLM's CPU build computes each linear layer with a copy packed for oneDNN: a write into
    the parameter would never be served, so a worker refuses in place."""
    with pytest.raises(ChildError, match="cannot receive in place: .* packed copy of it"):
        vllm.call("init", {**init_info(store.url, "no-inplace"), "mode": "inplace"})
    # no room for one staging copy: streamed, unless even one tensor is larger than a bucket
    with pytest.raises(ChildError, match="larger than one bucket .* raise staging_gb to at least"):
        vllm.call("init", {**init_info(store.url, "no-inplace"), "staging_gb": 1e-4})
