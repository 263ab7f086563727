"""verl's own harness around the verl engine, as tests/integrations/verl/test_verl.py runs it: a small
Qwen3-MoE checkpoint and the Ray job (verl's CheckpointEngineManager, its rollout
CheckpointEngineWorkerTest with the mock server adapter, two stand-in trainer ranks). Importing
verl's harness costs seconds of CPU: the test imports this module in its fixture, not when
pytest collects it (every pytest worker collects every test file)."""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch
import transformers
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineWorker
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from transport.integrations.verl.harness import Gate, StandInTrainer, rollout_worker_group

__all__ = ["BUCKET_MB", "Job", "make_qwen3_moe"]

#: the bucket of verl's update (update_weights_bucket_megabytes)
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

    #: the bytes of one bucket of verl's update
    bucket_bytes = BUCKET_MB << 20

    def __init__(self, model: Path) -> None:
        self.cfg = CheckpointEngineConfig(
            backend="transport",
            update_weights_bucket_megabytes=BUCKET_MB,
            engine_kwargs={"transport": {"timeout": 60, "delta": True}},
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
        # the rollout group's master port is held for the job's life (this process's)
        self.rollout, self.replicas, self.master_port = rollout_worker_group(
            rollout_pool, model_config, rollout_config, True
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

    def gate(self):
        """A new Gate (transport.integrations.verl.harness) to hold the trainer ranks at."""
        return Gate.remote()

    def pid(self, worker) -> int:
        return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
