"""verl's weight update with our checkpoint engine against verl's ``nixl`` engine, in one run.

The same harness for both (transport/integrations/verl/harness.py): verl's
``CheckpointEngineManager`` and rollout ``CheckpointEngineWorkerTest`` in Ray actors on the CPU,
two stand-in trainer ranks yielding a Qwen2 checkpoint as verl's FSDP engine does (every full
tensor on every rank), 2 and 4 rollout workers (TP=2 replicas). verl's nixl engine runs in its
CPU mode (``device="cpu"``; on a torch without CUDA with the two words of
``patch_nixl_for_cpu``). Per configuration: one warm-up update, then ``--updates`` timed ones
(the manager's whole ``update_weights``, as a trainer sees it); memory is each process's peak resident set during the timed updates
(VmHWM, reset after the warm-up) above its resident set before the first update, once every
engine has its agent and no bucket (verl's nixl engine makes its agent when it is built; ours
joins a store that the bench hosts in one ``prepare``, which allocates nothing): what the engine
holds (ours keeps its buckets between updates on the CPU; verl's nixl engine allocates them in
every ``prepare``) plus what an update adds at its peak. verl's mock adapter
clones every weight it receives and drops it (it checks nothing by default: checking keeps a copy
of the model and loads the checkpoint; ``--check`` does, after the last update, and the test
command runs the smallest run so: tests/test_benchmarks_servers.py).

    python benchmarks/verl_update.py                 # ~3 min: 330 MB of bf16, 64 MiB buckets
    python benchmarks/verl_update.py --hidden 512 --layers 4 --updates 3   # ~1 min
    python benchmarks/verl_update.py --delta 0.022 --engines nixl,transport,transport-delta

With ``--delta SHARE`` each update flips the lowest bit of SHARE of every tensor's elements, other
ones each update (so two updates differ in about twice SHARE), for every engine alike;
``transport-delta`` is ours with ``delta: true`` on every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
import transformers
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from transport.integrations.verl.engine import node_address
from transport.integrations.verl.harness import (
    NIXL_ON_CPU,
    StandInTrainer,
    peak_rss_bytes,
    rollout_worker_group,
    rss_bytes,
)
from transport.store.tcp import TcpStore

ENGINES = {
    "nixl": ({"device": "cpu"}, NIXL_ON_CPU),
    "transport": ({}, "transport.integrations.verl"),
    # ours with delta=True on every engine: each bucket as its changes (--delta sets the step)
    "transport-delta": ({"delta": True}, "transport.integrations.verl"),
}


def make_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def run_one(
    engine: str,
    workers: int,
    model: Path,
    bucket_mb: int,
    updates: int,
    store: str,
    delta: float = 0.0,
    check: bool = False,
) -> dict:
    kwargs, module = ENGINES[engine]
    backend = engine.removesuffix("-delta")
    if backend == "transport":
        kwargs = {**kwargs, "store": store}  # so that prepare() joins it: see the docstring
    cfg = CheckpointEngineConfig(
        backend=backend,
        update_weights_bucket_megabytes=bucket_mb,
        engine_kwargs={backend: kwargs},
        custom_backend_module=module,
    )
    pool = RayResourcePool(process_on_nodes=[2 + workers], max_colocate_count=1, use_gpu=False)
    trainer_pool, rollout_pool = split_resource_pool(pool, [2, workers])
    actor = RayWorkerGroup(
        resource_pool=trainer_pool,
        device_name="cpu",
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(StandInTrainer), model_path=str(model), config=cfg
        ),
    )
    rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=2, checkpoint_engine=cfg)
    rollout, replicas, master_port = rollout_worker_group(
        rollout_pool, HFModelConfig(path=str(model)), rollout_config, check
    )
    manager = CheckpointEngineManager(config=cfg, actor_wg=actor, replicas=replicas)
    pids = {"trainer": actor.pid(), "rollout": [pid_of(w) for w in rollout.workers]}
    if (
        backend == "transport"
    ):  # its Transport exists now, as verl's nixl agent does (no bucket yet)
        ray.get(
            actor.execute_checkpoint_engine(["prepare"] * actor.world_size)
            + rollout.execute_checkpoint_engine(["prepare"] * rollout.world_size)
        )
    before = {k: [rss_bytes(p) for p in v] for k, v in pids.items()}
    if delta:  # every update flips the lowest bit of ``delta`` of the elements, others each step
        actor.perturb_next(delta)
    manager.update_weights(global_steps=1)  # the warm-up
    for pid in [*pids["trainer"], *pids["rollout"]]:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    times = []
    for step in range(updates):
        start = time.perf_counter()
        manager.update_weights(global_steps=3 + 2 * step)
        times.append(time.perf_counter() - start)
    grew = {
        k: max(peak_rss_bytes(p) - b for p, b in zip(v, before[k], strict=False))
        for k, v in pids.items()
    }
    if check:  # every worker's weights of the last update against the checkpoint (raises)
        ray.get([w.check_weights.remote() for w in rollout.workers])
    for handle in list(actor.workers) + list(rollout.workers):
        ray.kill(handle)
    master_port.close()
    return {
        "engine": engine,
        "workers": workers,
        "update_s": statistics.median(times),
        "update_s_all": times,
        "trainer_mem": grew["trainer"],
        "rollout_mem": grew["rollout"],
        "checked": check,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument(
        "--workers", default="2,4", help="comma list of rollout worker counts (even: TP=2 replicas)"
    )
    p.add_argument("--engines", default="nixl,transport")
    p.add_argument(
        "--delta",
        type=float,
        default=0.0,
        help="each update flips the lowest bit of this share of every tensor's elements (0.022: "
        "one step of AdamW at lr 1e-6 in bf16); add transport-delta to --engines",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="verl's mock adapter keeps every weight it receives, and each rollout worker's are "
        "compared with the checkpoint after the last update (the memory figures then include "
        "that copy); not with --delta",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.check and args.delta:
        p.error("--check compares with the checkpoint, which --delta changes: give one of them")
    ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False)
    hosted = TcpStore(node_address(), 0, hosting="yes")
    store = f"tcp://{node_address()}:{hosted.port}?host=no"
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            nbytes = make_model(Path(tmp), args.hidden, args.layers, args.vocab)
            print(
                f"model: {nbytes / 2**20:.0f} MiB of bf16, buckets of {args.bucket_mb} MiB, 2 trainer ranks"
            )
            for workers in (int(w) for w in args.workers.split(",")):
                for engine in args.engines.split(","):
                    row = run_one(
                        engine,
                        workers,
                        Path(tmp),
                        args.bucket_mb,
                        args.updates,
                        store,
                        args.delta,
                        args.check,
                    )
                    rows.append(row)
                    print(
                        f"{engine:>10} x{workers}: update {row['update_s'] * 1e3:8.1f} ms (median of "
                        f"{args.updates}), memory grown: trainer rank {row['trainer_mem'] / 2**20:7.1f} MiB, "
                        f"rollout worker {row['rollout_mem'] / 2**20:7.1f} MiB",
                        flush=True,
                    )
    finally:
        ray.shutdown()
        hosted.close()
    by = {(r["engine"], r["workers"]): r for r in rows}
    for workers in sorted({r["workers"] for r in rows}):
        a, b = by.get(("nixl", workers)), by.get(("transport", workers))
        d = by.get(("transport-delta", workers))
        if b and d:
            print(
                f"x{workers}: ours with delta {b['update_s'] / d['update_s']:.2f}x faster than whole"
            )
        if a and b:
            print(
                f"x{workers}: ours {a['update_s'] / b['update_s']:.2f}x faster than verl's nixl; memory "
                f"ours/nixl: trainer {b['trainer_mem'] / max(a['trainer_mem'], 1):.2f}, "
                f"rollout {b['rollout_mem'] / max(a['rollout_mem'], 1):.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": nbytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
