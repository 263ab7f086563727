"""The verl engine in verl's own harness: verl's CheckpointEngineManager, its rollout
CheckpointEngineWorkerTest with the mock server adapter that checks every weight against the
Hugging Face checkpoint, its replicas, all in Ray actors on the CPU; two trainer ranks of the
stand-in for verl's FSDP trainer (transport/integrations/verl/harness.py says why and what it
yields). A small mixture of experts, Qwen3-MoE (8 experts per layer, fused as transformers holds
them; grouped-query attention, q/k norms, tied embeddings; the embedding is larger than a
bucket), with a secret. The tests share one job and run in order: three updates to
2 workers, a replica added (4 workers), a tensor of another shape, a worker killed mid-update, an
outsider, a trainer rank killed mid-update."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.slow, pytest.mark.timeout(900)]

if not os.environ.get("TRANSPORT_TEST_VERL"):
    pytest.importorskip("verl", reason="verl is not installed: bash examples/setup_verl.sh")

import ray  # noqa: E402
import transformers  # noqa: E402
from tests.checkpoint_engine.test_utils import create_rollout_worker_group  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.single_controller.ray.base import split_resource_pool  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig  # noqa: E402

import transport  # noqa: E402
from helpers.polling import wait_until  # noqa: E402
from transport.errors import SignatureError  # noqa: E402
from transport.integrations.verl.harness import Gate, StandInTrainer  # noqa: E402

SECRET = "verl-job-secret-0123"
BUCKET_MB = 1


def make_qwen3_moe(path: Path) -> Path:
    """A small Qwen3-MoE: 8 experts per layer (transformers holds them fused, 3-D), top 2,
    grouped-query attention with q/k norms, tied embeddings larger than a bucket."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


class Job:
    """The Ray job: two stand-in trainer ranks, four rollout workers (two TP=2 replicas)."""

    def __init__(self, model: Path) -> None:
        self.cfg = CheckpointEngineConfig(
            backend="transport",
            update_weights_bucket_megabytes=BUCKET_MB,
            engine_kwargs={"transport": {"timeout": 60}},
            custom_backend_module="transport.integrations.verl",
        )
        model_config = HFModelConfig(path=str(model), use_remove_padding=True)
        rollout_config = RolloutConfig(
            name="vllm", tensor_model_parallel_size=2, checkpoint_engine=self.cfg
        )
        pool = RayResourcePool(process_on_nodes=[6], max_colocate_count=1, use_gpu=False)
        trainer_pool, rollout_pool = split_resource_pool(pool, [2, 4])
        self.actor = RayWorkerGroup(
            resource_pool=trainer_pool,
            device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(StandInTrainer), model_path=str(model), config=self.cfg
            ),
        )
        self.rollout, self.replicas = asyncio.run(
            create_rollout_worker_group(rollout_pool, model_config, rollout_config, True)
        )
        assert len(self.replicas) == 2 and len(self.rollout.workers) == 4
        self.manager = CheckpointEngineManager(
            config=self.cfg, actor_wg=self.actor, replicas=[self.replicas[0]]
        )

    def update(self, step: int) -> dict:
        return self.manager.update_weights(
            global_steps=step
        )  # verl makes it blocking outside a loop

    def check(self, workers) -> None:
        ray.get([w.check_weights.remote() for w in workers])

    def start_update(self, workers, step: int) -> tuple[RayWorkerGroup, list]:
        """verl's manager's steps 4 and 5 (build the group, start every worker's update),
        keeping each worker's result, which the manager's ray.get of them all does not."""
        rollout = RayWorkerGroup(
            worker_handles=list(workers),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker)),
        )
        self.manager.build_process_group(rollout)
        return rollout, self.actor.update_weights(global_steps=step) + rollout.update_weights(
            global_steps=step
        )

    def pid(self, worker) -> int:
        return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
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


def test_a_tensor_of_another_shape_is_refused_with_its_name(job):
    job.actor.flatten_next("model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        job.update(7)
    assert (
        "model.layers.1.self_attn.k_proj.weight arrived as bfloat16[16384] but was bfloat16[64, 256]"
        in str(info.value)
    )
    job.actor.flatten_next(None)
    job.update(9)
    job.check(job.rollout.workers)


def test_a_worker_killed_mid_update_is_dropped_and_the_others_complete(job):
    w = job.rollout.workers
    gate = Gate.remote()
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
    infos = ray.get(job.actor.execute_checkpoint_engine(["prepare"] * 2))
    worker = ray.get(job.rollout.workers[0].execute_checkpoint_engine.remote("prepare"))
    for secret in (None, "not-the-job-secret"):
        with transport.Transport(
            "mallory", store=infos[0].store, namespace="verl", secret=secret
        ) as t:
            with pytest.raises(SignatureError):
                t.put(torch.ones(BUCKET_MB << 20, dtype=torch.uint8), worker.name, "verl.slots")
            with pytest.raises(SignatureError):
                t.get(torch.zeros(16, dtype=torch.uint8), worker.name, "verl.slots")
    job.update(15)
    job.check(job.rollout.workers[:2])


def test_a_trainer_rank_killed_mid_update_fails_it_on_every_worker_naming_the_rank(job):
    gate = Gate.remote()
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
