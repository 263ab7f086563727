"""One full weight update of a vLLM server (start to finish, measured at the trainer) through the
``transport`` backend, against what a user without it does on one machine and against the
floor, interleaved round by round in one run:

* ``transport``: the trainer publishes the version into the worker's staging memory, then
  vLLM's start / update / finish (``TransportTrainer.send_weights``);
* ``shm``: the trainer saves a safetensors checkpoint to shared memory (/dev/shm) and vLLM
  reloads it (``reload_weights`` through ``/collective_rpc``);
* ``floor``: vLLM's own loader from tensors already in its memory: an update of a version that
  already landed (start / update / finish with no transfer).

Also the host memory the update path adds: the vLLM worker's resident set before and after it
joined and took a first version (its two staging slots), and the trainer's.

    bash examples/setup_vllm.sh
    .venv/bin/python benchmarks/vllm_update.py --json benchmarks/results-vllm.json

The server runs vLLM's CPU build here, one worker (a separate process), float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MiB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def group_rss(pgid: int) -> dict[int, int]:
    """Resident set of every process of a process group (the server and its workers)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out[int(d)] = rss(int(d))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from transport.integrations.vllm import register
    from transport.integrations.vllm.server import VllmServer, free_port
    from transport.integrations.vllm.trainer import HTTPClient, TransportTrainerInitInfo

    register()
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="transport-bench-", dir="/dev/shm"))
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, max_position_embeddings=256,
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    state = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    model.save_pretrained(work / "model", safe_serialization=True)
    shutil.copy(work / "model" / "config.json", shm / "config.json")
    print(f"model: {len(state)} tensors, {nbytes / MiB:.0f} MiB float32", flush=True)

    server_args = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                   "--block-size", "32", "--skip-tokenizer-init")  # fmt: skip
    server = VllmServer(work / "model", work / "vllm.log", args=server_args, start_timeout=600)
    url = server.url
    try:
        trainer_before = rss(os.getpid())
        workers_before = group_rss(server.proc.pid)
        engine = WeightTransferTrainerFactory.trainer_init(
            TransportTrainerInitInfo(f"tcp://127.0.0.1:{free_port()}", rank=0, timeout=300),
            client=HTTPClient(url),
            source=ModuleSource(model),
        )
        # the worker's pid is in its peer name (vllm-HOST-PID-rRANK)
        first = engine.send_weights(1)
        (worker,) = first.done
        worker_pid = int(worker.rsplit("-", 2)[1])
        worker_after = rss(worker_pid)
        trainer_after = rss(os.getpid())
        times: dict[str, list[float]] = {"transport": [], "shm": [], "floor": []}
        # of transport's: the part in which vLLM loads (it serves while the version is written)
        loading: list[float] = []
        for r in range(args.rounds):
            v = 2 + r
            with torch.no_grad():
                for t in state.values():
                    t.add_(1e-3)
            t0 = time.perf_counter()
            engine.send_weights(v)
            times["transport"].append(time.perf_counter() - t0)
            loading.append(engine.last_times.update_s)

            t0 = time.perf_counter()  # the same version again: already in the worker's memory
            server.post("start_weight_update")
            server.post("update_weights", {"update_info": {"version": v}})
            server.post("finish_weight_update", {"weight_version": str(v)})
            times["floor"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            save_file(state, str(shm / "model.safetensors"))
            server.post("collective_rpc",
                        {"method": "reload_weights", "kwargs": {"weights_path": str(shm)}})  # fmt: skip
            times["shm"].append(time.perf_counter() - t0)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
                  flush=True)  # fmt: skip
        median = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "model_mib": round(nbytes / MiB, 1),
            "tensors": len(state),
            "rounds": args.rounds,
            "median_s": median,
            "all_s": times,
            "transport_vs_shm": median["shm"] / median["transport"],
            "transport_vs_floor": median["transport"] / median["floor"],
            "transport_loading_median_s": statistics.median(loading),
            "worker_rss_growth_mib": round((worker_after - workers_before[worker_pid]) / MiB, 1),
            "worker_staging_mib": round(2 * nbytes / MiB, 1),
            "trainer_rss_growth_mib": round((trainer_after - trainer_before) / MiB, 1),
        }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        engine.shutdown()
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
