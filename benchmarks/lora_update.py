"""A LoRA adapter's update of a running vLLM server, from the start of the publish until vLLM
answers a one-token request with the new version, three ways in one run (one server):

* ``transport``: the adapter's A and B through transport into vLLM's LoRA slots from memory
  (``AdapterTrainer.send`` over the adapter routes), then the request naming the adapter;
* ``file``: what frameworks do today: peft's ``save_pretrained`` into a folder, vLLM's
  ``/v1/load_lora_adapter`` with ``load_inplace``, then the request naming it;
* the one-token request alone (no update before it), so that the update's own time can be told
  apart (``update_only_file_over_transport``: both times less the request's);
* ``merged``: TRL's way: the adapter merged into the base, every weight of the model sent
  through transport's own backend (``TransportTrainer.send_weights``, sharded), the adapter
  unmerged, then a request to the base model. Measured last: vLLM drops every adapter at the
  end of a weight update.

Bytes are what the trainer wrote to the server's workers (``Transport.traffic``). The model has
Qwen2.5-0.5B's configuration (its shapes, random weights: no hub here; ``--layers`` and
``--vocab`` make it smaller), float32, every linear layer a target, at each rank of ``--ranks``.

    bash examples/setup_vllm.sh
    .venv/bin/python benchmarks/lora_update.py --ranks 16,64 --rounds 5 --json results-lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import torch

MiB = 2**20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: one prompt of one token: the request is the least generation that shows the version
PROMPT = [[42]]


def qwen_config(layers: int, vocab: int = 151936) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        dtype="float32",
    )


#: the values vLLM's ``--max-lora-rank`` accepts (vLLM 0.32)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def traffic(t: Any) -> int:
    return sum(x.written for x in t.traffic().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    ap.add_argument(
        "--vocab",
        type=int,
        default=151936,
        help="Qwen2.5-0.5B has 151936 (its tied embedding: 519 MiB of float32, which no adapter "
        "targets)",
    )
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--merged-rounds", type=int, default=3, help="0: leave out TRL's merged way")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks must be a comma list of whole numbers, got {args.ranks!r}")
    # the server's --max-lora-rank is the largest of them, and vLLM accepts only these
    if max(ranks) not in VLLM_MAX_LORA_RANKS or min(ranks) < 1:
        ap.error(
            f"--ranks {args.ranks}: the largest becomes vLLM's --max-lora-rank, which must be one "
            f"of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}"
        )

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from transport.integrations.vllm import register
    from transport.integrations.vllm.lora_trainer import AdapterTrainer, AdapterTrainerInfo
    from transport.integrations.vllm.server import VllmServer
    from transport.integrations.vllm.trainer import (
        HTTPClient,
        TransportTrainer,
        TransportTrainerInitInfo,
    )
    from transport.store.tcp import TcpStore

    register()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    base = AutoModelForCausalLM.from_config(qwen_config(args.layers, args.vocab)).float().eval()
    base.save_pretrained(work / "model", safe_serialization=True)
    model_bytes = sum(p.numel() * 4 for p in base.parameters())
    print(
        f"model: Qwen2.5-0.5B shapes, {args.layers} layers, {model_bytes / MiB:.0f} MiB", flush=True
    )
    store = TcpStore("127.0.0.1", 0, hosting="yes")
    url = f"tcp://127.0.0.1:{store.port}?host=no"
    server_args = (
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--skip-tokenizer-init",
        "--enable-lora",
        "--max-lora-rank",
        str(max(ranks)),
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "8",
        "--middleware",
        "transport.integrations.vllm.lora_routes.AdapterRoutes",
        "--worker-extension-cls",
        "transport.integrations.vllm.extension.TransportState",
    )
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    results: dict[str, Any] = {
        "model": {"layers": args.layers, "vocab": args.vocab, "mib": model_bytes / MiB}
    }
    server = VllmServer(work / "model", work / "server.log", args=server_args, env=env)
    try:
        for rank in ranks:
            peft_model = get_peft_model(
                base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
            ).eval()
            trainer = AdapterTrainer(
                peft_model,
                HTTPClient(server.url),
                AdapterTrainerInfo(store=url, adapter=f"r{rank}", timeout=120),
            )
            adapter_bytes = sum(t.numel() * t.element_size() for t in trainer.tensors.values())
            ours, files, sent, alone = [], [], [], []
            folder = work / f"adapter-r{rank}"
            for k in range(args.rounds + 1):
                with torch.no_grad():
                    for n, p in peft_model.named_parameters():
                        if "lora_" in n:
                            p.normal_(0, 0.01)
                before = traffic(trainer.transport)
                t0 = time.perf_counter()
                trainer.send(k + 1)
                server.complete(PROMPT, 1, model=f"r{rank}")
                t1 = time.perf_counter()
                sent.append(traffic(trainer.transport) - before)
                peft_model.save_pretrained(folder, safe_serialization=True)
                body = {"lora_name": f"file-r{rank}", "lora_path": str(folder)}
                if k:
                    body["load_inplace"] = True
                r = requests.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=300)
                r.raise_for_status()
                server.complete(PROMPT, 1, model=f"file-r{rank}")
                t2 = time.perf_counter()
                server.complete(PROMPT, 1, model=f"r{rank}")  # the request alone
                t3 = time.perf_counter()
                if k:  # the first of each is a warm-up
                    ours.append(t1 - t0)
                    files.append(t2 - t1)
                    alone.append(t3 - t2)
                print(
                    f"rank {rank} round {k}: transport {t1 - t0:.3f} s, file {t2 - t1:.3f} s",
                    flush=True,
                )
            results[f"r{rank}"] = {
                "adapter_mib": adapter_bytes / MiB,
                "transport_s": statistics.median(ours),
                "file_s": statistics.median(files),
                "sent_mib": statistics.median(sent[1:]) / MiB,
                "file_over_transport": statistics.median(files) / statistics.median(ours),
                "request_s": statistics.median(alone),
                "update_only_file_over_transport": (
                    statistics.median(files) - statistics.median(alone)
                )
                / (statistics.median(ours) - statistics.median(alone)),
            }
            trainer.close()
            base = peft_model.unload()  # the base model again, for the next rank
        if args.merged_rounds > 0:  # 0: the adapter ways only
            # merged: the last rank's adapter merged into the base, every weight sent
            rank = ranks[-1]
            peft_model = get_peft_model(
                base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
            )
            with torch.no_grad():
                for n, p in peft_model.named_parameters():
                    if "lora_" in n:
                        p.normal_(0, 0.01)
            source = {
                n.replace(".base_layer", ""): p.detach()
                for n, p in peft_model.get_base_model().named_parameters()
                if "lora_" not in n
            }
            info = TransportTrainerInitInfo(store=url, namespace="merged", timeout=300, rank=0)
            merged_trainer = TransportTrainer.trainer_init(
                info, client=HTTPClient(server.url), source=source
            )
            merged, merged_sent = [], []
            for k in range(args.merged_rounds + 1):
                before = traffic(merged_trainer.transport)
                t0 = time.perf_counter()
                peft_model.merge_adapter()
                merged_trainer.send_weights(k + 1)
                peft_model.unmerge_adapter()
                server.complete(PROMPT, 1)
                t1 = time.perf_counter()
                merged_sent.append(traffic(merged_trainer.transport) - before)
                print(
                    f"merged round {k}: {t1 - t0:.3f} s, {merged_sent[-1] / MiB:.0f} MiB",
                    flush=True,
                )
                if k:
                    merged.append(t1 - t0)
            merged_trainer.shutdown()
            results["merged"] = {
                "rank": rank,
                "s": statistics.median(merged),
                "sent_mib": statistics.median(merged_sent[1:]) / MiB,
            }
            for r in ranks:
                m = results[f"r{r}"]
                m["merged_over_transport_s"] = results["merged"]["s"] / m["transport_s"]
                m["merged_bytes_over_transport"] = results["merged"]["sent_mib"] / m["sent_mib"]
    except BaseException:
        print(f"the server's log ends with:\n{server.tail(40)}", file=sys.stderr)
        raise
    finally:
        server.kill()
        store.close()
        shutil.rmtree(work, ignore_errors=True)  # the model: hundreds of MiB
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
