"""The verl engine in verl's own harness: verl's CheckpointEngineManager, its rollout
CheckpointEngineWorkerTest with the mock server adapter that checks every weight against the
Hugging Face checkpoint, its replicas, all in Ray actors on the CPU; two trainer ranks of the
stand-in for verl's FSDP trainer (transport/integrations/verl/harness.py says why and what it
yields). A small mixture of experts, Qwen3-MoE (8 experts per layer, fused as transformers holds
them; grouped-query attention, q/k norms, tied embeddings; the embedding is larger than a
bucket), with a secret, every engine with ``delta`` (copies of what it sent or received). The
tests share one job and run in order: three updates to 2 workers, a replica added (4 workers), a
step that moves 2% of the weights and back (as changes), a tensor of another shape (and the next
update started while the refused one still runs), a worker killed mid-update, an outsider, a
trainer rank killed mid-update."""

from __future__ import annotations

import os
import signal

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.verl, pytest.mark.slow, pytest.mark.timeout(900)]

if not os.environ.get("TRANSPORT_TEST_VERL"):
    pytest.importorskip("verl", reason="verl is not installed: bash examples/setup_verl.sh")

# verl's harness (helpers/verl_job.py) is imported by the job fixture, not when pytest collects
# this file: every pytest worker collects every test file, and importing verl costs seconds
import ray  # noqa: E402

import transport  # noqa: E402
from helpers.polling import wait_until  # noqa: E402
from transport import SignatureError  # noqa: E402

SECRET = "verl-job-secret-0123"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from helpers.verl_job import Job, make_qwen3_moe

    model = make_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"))
    ray.init(
        num_cpus=64,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"TRANSPORT_SECRET": SECRET}},
    )
    try:
        yield Job(model)
    finally:
        ray.shutdown()


def test_three_updates_reach_two_workers_then_an_added_replica(job):
    w = job.rollout.workers
    job.update(1)
    job.check(w[:2])
    job.update(2)  # every weight negated: a leftover of update 1 would pass the check below
    for worker in w[:2]:
        with pytest.raises(ray.exceptions.RayTaskError, match="not equal"):
            job.check([worker])
    metrics = job.update(3)
    job.check(w[:2])
    sent = [metrics[f"transport/rank{r}/buckets_sent"] for r in range(2)]
    assert min(sent) >= 2 and abs(sent[0] - sent[1]) <= 1, metrics  # both ranks sent
    job.manager.add_replicas([job.replicas[1]])
    job.update(5)
    job.check(w)


def test_a_step_that_moves_few_weights_goes_as_changes_and_lands_exactly(job):
    """Every engine keeps copies (delta): an update that flips the lowest bit of 2% of the
    weights goes as changes, a small part of the bytes, and verl's checker sees weights that are
    not the checkpoint's; the update back to it goes as changes too, and the checker passes:
    every weight bit for bit."""
    w = job.rollout.workers
    job.update(11)  # the checkpoint, as update 5 left it: every engine's copies hold the same
    job.check(w)
    job.actor.perturb_next(0.02)
    moved = job.update(13)
    for worker in w:
        with pytest.raises(ray.exceptions.RayTaskError, match="not equal"):
            job.check([worker])
    job.actor.perturb_next(0.0)
    back = job.update(15)
    job.check(w)
    for metrics in (moved, back):
        for r in range(2):
            buckets = metrics[f"transport/rank{r}/buckets_sent"]
            assert metrics[f"transport/rank{r}/buckets_as_changes"] == buckets > 0, metrics
            # each bucket to each of the 4 workers: a small part of a full bucket
            per_bucket = metrics[f"transport/rank{r}/bytes_sent"] / buckets / len(w)
            assert per_bucket < 0.2 * job.bucket_bytes, metrics


K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def test_a_tensor_of_another_shape_is_refused_and_the_next_update_supersedes_the_refused_one(
    job,
):
    """Every worker refuses update 7, which flattens a tensor, naming it. verl's manager moves
    on at the first error (Ray's get fails fast) while the trainer ranks still send update 7
    (here: held at a gate at tensor 30): update 9 begins on every engine and is held too, at
    tensor 20 with buckets out, before update 7 goes on. Update 7 then stops at each rank at
    its next step, naming update 9, and writes nothing more: update 9 lands whole."""
    w = job.rollout.workers
    first, second = job.gate(), job.gate()
    job.actor.flatten_next(K_PROJ)
    job.actor.hold_at(30, first)
    _, refused = job.start_update(w, 7)
    for ref in refused[2:]:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref)
        assert f"{K_PROJ} arrived as bfloat16[16384] but was bfloat16[64, 256]" in str(info.value)
    wait_until(lambda: ray.get(first.count.remote()) == 2, 300, "both ranks held in update 7")
    job.actor.flatten_next(None)
    job.actor.hold_at(20, second)
    _, refs = job.start_update(w, 9)
    wait_until(lambda: ray.get(second.count.remote()) == 2, 300, "both ranks held in update 9")
    ray.get(first.open.remote())
    for ref in refused[:2]:
        with pytest.raises(ray.exceptions.RayTaskError, match="was superseded by update"):
            ray.get(ref)
    ray.get(second.open.remote())
    ray.get(refs)
    job.check(w)


def test_a_worker_killed_mid_update_is_dropped_and_the_others_complete(job):
    w = job.rollout.workers
    gate = job.gate()
    job.actor.hold_at(30, gate)  # of 35 tensors: most buckets are out, not all
    victim = job.pid(w[3])
    rollout, refs = job.start_update(w, 11)
    wait_until(lambda: ray.get(gate.count.remote()) == 2, 300, "both trainer ranks at the gate")
    os.kill(victim, signal.SIGKILL)
    ray.get(gate.open.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(refs[5])
    ray.get(refs[2:5])  # the three that live took the whole update ...
    for metrics in ray.get(refs[:2]):  # ... and each trainer rank dropped the dead one
        rank = next(k for k in metrics if k.endswith("/dropped")).split("/")[1]
        assert metrics[f"transport/{rank}/dropped"] == 1.0, metrics
    job.check(w[:3])
    job.manager.remove_replicas([job.replicas[1]])
    job.update(13)
    job.check(w[:2])


def test_outsiders_can_neither_write_nor_read_a_worker(job):
    # a rollout worker joins the store and exposes its slots at its first update: one has run
    # whether or not this test runs after the others
    job.update(14)
    infos = ray.get(job.actor.execute_checkpoint_engine(["prepare"] * 2))
    worker = ray.get(job.rollout.workers[0].execute_checkpoint_engine.remote("prepare"))
    for secret in (None, "not-the-job-secret"):
        with transport.Transport(
            "mallory", store=infos[0].store, namespace="verl", secret=secret
        ) as t:
            with pytest.raises(SignatureError):
                t.put(torch.ones(job.bucket_bytes, dtype=torch.uint8), worker.name, "verl.slots")
            with pytest.raises(SignatureError):
                t.get(torch.zeros(16, dtype=torch.uint8), worker.name, "verl.slots")
    job.update(15)
    job.check(job.rollout.workers[:2])


def test_a_trainer_rank_killed_mid_update_fails_it_on_every_worker_naming_the_rank(job):
    gate = job.gate()
    job.actor.hold_at(10, gate)
    victim = job.actor.pid()[1]
    rollout, refs = job.start_update(job.rollout.workers[:2], 17)
    wait_until(lambda: ray.get(gate.count.remote()) == 2, 300, "both trainer ranks at the gate")
    os.kill(victim, signal.SIGKILL)
    ray.get(gate.open.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="trainer rank 1 .* is gone"):
        ray.get(refs[0])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(refs[1])
    for ref in refs[2:]:
        with pytest.raises(
            ray.exceptions.RayTaskError, match=r"trainer rank 1 \(verl-[0-9a-f]+\) is gone"
        ):
            ray.get(ref)


def test_bad_settings_are_refused_naming_the_rule():
    from transport.integrations.verl import TransportCheckpointEngine

    for size in (0, -1, 100):
        with pytest.raises(ValueError, match="update_weights_bucket_megabytes >= 1"):
            TransportCheckpointEngine(bucket_size=size)
    with pytest.raises(ValueError, match="relay_degree is None or 0 to 64"):
        TransportCheckpointEngine(bucket_size=1 << 20, relay_degree=-2)
    for delta in ("yes", 1, None):
        with pytest.raises(ValueError, match="delta is true, false or auto"):
            TransportCheckpointEngine(bucket_size=1 << 20, delta=delta)
    auto = TransportCheckpointEngine(bucket_size=1 << 20, delta="auto")
    assert auto.copies is not None and auto.policy is not None and auto.policy.auto
    engine = TransportCheckpointEngine(
        bucket_size=1 << 20, store="tcp://127.0.0.1:9?host=no&timeout=2"
    )
    with pytest.raises(
        transport.StoreError, match=r"could not join store tcp://127.0.0.1:9\?host=no&timeout=2"
    ):
        engine.prepare()
    with pytest.raises(
        TypeError,
        match="set checkpoint_engine.backend=transport on the trainer and the rollout side",
    ):
        TransportCheckpointEngine.build_topology(1, 1, [{"agent": "nixl"}, {"agent": "nixl"}])
