"""A trainer teaches a small Llama to count and, after every step, syncs its weights into a vLLM
server through the ``transport`` weight-transfer backend; vLLM's greedy completions move from
noise to counting.

    bash examples/setup_vllm.sh && .venv/bin/python examples/vllm_rl.py

What happens: a Llama is built from a config with random weights and saved locally (no hub);
vLLM's OpenAI server (CPU build here, ``--weight-transfer-config '{"backend": "transport"}'``,
started by ``transport.integrations.vllm.server.VllmServer``) starts on it. The trainer (this process) hosts the embedded store, and vLLM's worker joins the
trainer's weight group through it. Each step: one optimizer step on sequences of consecutive
tokens, then ``engine.send_weights()`` (publish into the worker's staging memory, then vLLM's
start / update / finish, prefix cache reset), then a greedy completion from vLLM. At the end
vLLM's tokens must equal transformers' greedy tokens on the trainer's final weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB, FIRST = 256, 4  # token ids FIRST..VOCAB-1 are the words "w4".."w255"
#: vLLM should continue each by counting on (the first: 46 47 48 ...)
PROMPTS = [list(range(a, a + 6)) for a in (40, 100, 160, 220)]
NEW_TOKENS = 8


def make_model(folder: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def batch(size: int, length: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(FIRST, VOCAB - length, (size, 1), generator=g)
    return starts + torch.arange(length)


def right(got: list[list[int]]) -> int:
    """How many continued tokens are the counting ones."""
    return sum(
        t == p[-1] + 1 + k for p, ids in zip(PROMPTS, got, strict=True) for k, t in enumerate(ids)
    )


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from transport.integrations.vllm import register
    from transport.integrations.vllm.server import VllmServer
    from transport.integrations.vllm.trainer import HTTPClient, TransportTrainerInitInfo
    from transport.store import reserve_port

    register()  # the trainer runs no vLLM engine: register the backend's trainer side here
    work = Path(tempfile.mkdtemp(prefix="vllm-rl-"))
    model = make_model(work / "model")
    t0 = time.monotonic()
    server_args = (
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "128",
        "--block-size",
        "32",
        "--skip-tokenizer-init",
    )
    with (
        VllmServer(work / "model", work / "vllm.log", args=server_args) as server,
        reserve_port() as held,
    ):
        url = server.url
        print(f"vLLM up in {time.monotonic() - t0:.0f} s (log: {server.log})", flush=True)
        # the embedded store, hosted by this trainer on a port held for this run
        store = f"tcp://127.0.0.1:{held.port}"
        engine = WeightTransferTrainerFactory.trainer_init(
            TransportTrainerInitInfo(store, rank=0, timeout=60),
            client=HTTPClient(url),
            source=ModuleSource(model),
        )
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(1)
        first = PROMPTS[0]
        print(
            f"{len(PROMPTS)} prompts, the first {words(first)}: counting continues it with "
            f"{words(list(range(first[-1] + 1, first[-1] + 1 + NEW_TOKENS)))}"
        )
        total = len(PROMPTS) * NEW_TOKENS
        got = server.complete(PROMPTS, NEW_TOKENS)
        print(
            f"step   0 (random init)             vLLM: {words(got[0])}  ({right(got)}/{total} right)"
        )
        syncs = []
        for step in range(1, args.steps + 1):
            model.train()
            seq = batch(32, 16, g)
            loss = model(input_ids=seq, labels=seq).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = time.perf_counter()
            engine.send_weights(step)
            syncs.append(time.perf_counter() - t)
            got = server.complete(PROMPTS, NEW_TOKENS)
            print(
                f"step {step:3d} loss {loss.item():5.2f} sync {syncs[-1] * 1e3:6.1f} ms "
                f"vLLM: {words(got[0])}  ({right(got)}/{total} right)",
                flush=True,
            )
        # the check: vLLM serves exactly the trainer's last weights
        model.eval()
        with torch.no_grad():
            ref = model.generate(
                torch.tensor(PROMPTS),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        ref_ids = ref[:, len(PROMPTS[0]) :].tolist()
        served = server.get("weight_info")["weight_version"]
        syncs.sort()
        print(
            f"sync per step: median {syncs[len(syncs) // 2] * 1e3:.1f} ms, "
            f"max {syncs[-1] * 1e3:.1f} ms over {len(syncs)} steps; vLLM serves version {served}"
        )
        engine.shutdown()
        if got != ref_ids or served != str(args.steps):
            sys.exit(
                f"vllm_rl: FAILED: vLLM served {got} (version {served}), transformers {ref_ids}"
            )
        print("vllm_rl: OK")


if __name__ == "__main__":
    main()
