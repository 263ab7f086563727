"""TRL's AsyncGRPOTrainer trains a small Llama against a vLLM server and syncs every step
through transport: one argument, ``weight_transfer=TransportWeightTransfer(...)``.

    bash examples/setup_vllm.sh && .venv/bin/python examples/trl_grpo.py [--lora]

What happens: the model and its digits tokenizer are made here (examples/trl_task.py: no hub)
and vLLM's OpenAI server starts on them with ``--weight-transfer-config '{"backend":
"transport"}'`` (with ``--lora``: LoRA on, transport's adapter routes and worker extension).
TRL's trainer (this process; on a CPU-only torch built inside ``cpu_trainer()``) samples
completions from vLLM, rewards each "7" (trl_task.py) and after every optimizer step syncs:
the whole model, or with ``--lora`` only the adapter, which vLLM serves under the model's name.
At the end vLLM's greedy tokens must equal transformers' on the trainer's final weights (and,
syncing the whole model, the reward must have risen).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trl_task, for TRL's reward process

import trl_task  # noqa: E402

#: the server's arguments for the small model (the CPU build: float32, no CUDA graphs)
SERVER_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "128")
#: what a server that takes adapters adds: LoRA on, transport's adapter routes and worker side
LORA_SERVER_ARGS = (
    "--enable-lora",
    "--max-lora-rank",
    "16",
    "--max-loras",
    "2",
    "--middleware",
    "transport.integrations.vllm.lora_routes.AdapterRoutes",
    "--worker-extension-cls",
    "transport.integrations.vllm.extension.TransportState",
)


def grpo_config(
    out: Path, url: str, steps: int, lr: float, accumulation: int = 4, queue: int = 64
) -> object:
    """TRL's configuration for the task: 8 completions of 8 tokens per prompt, ``accumulation``
    micro-batches of up to 128 tokens per optimizer step and a sync after each, at most one
    version between a sample and the step it trains, at most ``queue`` samples waiting (and
    half as many requests in flight: TRL's rollouts outrun a CPU trainer, and the samples they
    make beyond that are only dropped as stale)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(out),
        vllm_server_base_url=url,
        max_steps=steps,
        learning_rate=lr,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation,
        num_generations=8,
        max_completion_length=trl_task.COMPLETION,
        temperature=1.0,
        max_staleness=1,
        queue_maxsize=queue,
        max_inflight_tasks=queue // 2,
        logging_steps=1,
        report_to=[],
        use_cpu=not _has_cuda(),
        bf16=False,
        dtype="float32",
        save_strategy="no",
    )


def lora_config() -> object:
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=None, help="default 1e-2, with --lora 5e-2")
    ap.add_argument("--lora", action="store_true", help="train and sync a LoRA adapter only")
    args = ap.parse_args()
    lr = args.lr or (5e-2 if args.lora else 1e-2)

    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from transport.integrations.trl import TransportWeightTransfer
    from transport.integrations.trl.cpu import cpu_trainer
    from transport.integrations.vllm.server import VllmServer
    from transport.store import reserve_port

    work = Path(tempfile.mkdtemp(prefix="trl-grpo-"))
    folder = trl_task.make_model(work / "model")
    server_args = SERVER_ARGS + (LORA_SERVER_ARGS if args.lora else ())
    t0 = time.monotonic()
    with VllmServer(folder, work / "vllm.log", args=server_args) as server, reserve_port() as held:
        print(f"vLLM up in {time.monotonic() - t0:.0f} s (log: {server.log})", flush=True)
        # the embedded store, hosted by the trainer on a port held for this run
        store = f"tcp://127.0.0.1:{held.port}"
        transfer = TransportWeightTransfer(
            server.url, store=store, adapter="policy" if args.lora else None
        )
        with cpu_trainer():  # a no-op where torch has CUDA
            trainer = AsyncGRPOTrainer(
                model=str(folder),
                reward_funcs=trl_task.sevens_reward,
                args=grpo_config(work / "out", server.url, args.steps, lr),
                train_dataset=Dataset.from_dict({"prompt": trl_task.prompts() * 100}),
                weight_transfer=transfer,
                # adapters: TRL hands the transfer its peft model when training begins
                callbacks=[transfer] if args.lora else None,
                peft_config=lora_config() if args.lora else None,
            )
        trainer.train()
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        for r, s in zip(rewards, transfer.history, strict=False):
            print(f"version {s.version:3d}: reward {r:.3f}, sync {s.seconds * 1e3:7.1f} ms")
        got = server.complete(trl_task.CHECK_PROMPTS, trl_task.COMPLETION)
        want = trl_task.greedy(trl_task.reference(folder, trainer.model))
        what = "adapter" if args.lora else "model"
        print(f"{len(transfer.history)} syncs of the {what}; vLLM {got}, transformers {want}")
        # the whole model learns within ten steps; an adapter on three projections, slower
        if got != want or (not args.lora and rewards[-1] <= rewards[0]):
            sys.exit(f"trl_grpo: FAILED (rewards {[round(r, 3) for r in rewards]})")
        print("trl_grpo: OK")


if __name__ == "__main__":
    main()
