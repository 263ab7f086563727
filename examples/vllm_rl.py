"""A trainer teaches a small Llama to count and, after every step, syncs its weights into a vLLM
server through the ``transport`` weight-transfer backend; vLLM's greedy completions move from
noise to counting.

    bash examples/setup_vllm.sh && .venv/bin/python examples/vllm_rl.py

What happens: a Llama is built from a config with random weights and saved locally (no hub);
vLLM's OpenAI server (CPU build here, ``--weight-transfer-config '{"backend": "transport"}'``)
starts on it. The trainer (this process) hosts the embedded store, and vLLM's worker joins the
trainer's weight group through it. Each step: one optimizer step on sequences of consecutive
tokens, then ``engine.send_weights()`` (publish into the worker's staging memory, then vLLM's
start / update / finish, prefix cache reset), then a greedy completion from vLLM. At the end
vLLM's tokens must equal transformers' greedy tokens on the trainer's final weights.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

VOCAB, FIRST = 256, 4  # token ids FIRST..VOCAB-1 are the words "w4".."w255"
#: vLLM should continue each by counting on (the first: 46 47 48 ...)
PROMPTS = [list(range(a, a + 6)) for a in (40, 100, 160, 220)]
NEW_TOKENS = 8


def make_model(folder: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def batch(size: int, length: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(FIRST, VOCAB - length, (size, 1), generator=g)
    return starts + torch.arange(length)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "128", "--block-size", "32",
        "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
        "--weight-transfer-config", '{"backend": "transport"}',
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            sys.exit(f"vLLM exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).ok:
                return
        except requests.RequestException:
            pass
        threading.Event().wait(0.5)
    sys.exit(f"vLLM was not up within {timeout} s:\n{log.read_text()[-3000:]}")


def complete(url: str, model: str) -> list[list[int]]:
    """vLLM's greedy continuation of every prompt (one request)."""
    r = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })  # fmt: skip
    r.raise_for_status()
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


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
    from transport.integrations.vllm.trainer import HTTPClient, TransportTrainerInitInfo

    register()  # the trainer runs no vLLM engine: register the backend's trainer side here
    work = Path(tempfile.mkdtemp(prefix="vllm-rl-"))
    model = make_model(work / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "vllm.log"
    t0 = time.monotonic()
    server = start_server(work / "model", port, log)
    try:
        wait_healthy(server, url, log, timeout=300)
        print(f"vLLM up in {time.monotonic() - t0:.0f} s (log: {log})", flush=True)
        store = f"tcp://127.0.0.1:{free_port()}"  # the embedded store, hosted by this trainer
        engine = WeightTransferTrainerFactory.trainer_init(
            TransportTrainerInitInfo(store, rank=0, timeout=60),
            client=HTTPClient(url),
            source=ModuleSource(model),
        )
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(1)
        first = PROMPTS[0]
        print(f"{len(PROMPTS)} prompts, the first {words(first)}: counting continues it with "
              f"{words(list(range(first[-1] + 1, first[-1] + 1 + NEW_TOKENS)))}")  # fmt: skip
        total = len(PROMPTS) * NEW_TOKENS
        got = complete(url, str(work / "model"))
        print(f"step   0 (random init)             vLLM: {words(got[0])}  ({right(got)}/{total} right)")
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
            got = complete(url, str(work / "model"))
            print(f"step {step:3d} loss {loss.item():5.2f} sync {syncs[-1] * 1e3:6.1f} ms "
                  f"vLLM: {words(got[0])}  ({right(got)}/{total} right)", flush=True)  # fmt: skip
        # the check: vLLM serves exactly the trainer's last weights
        model.eval()
        with torch.no_grad():
            ref = model.generate(torch.tensor(PROMPTS), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        ref_ids = ref[:, len(PROMPTS[0]) :].tolist()
        served = requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
        syncs.sort()
        print(f"sync per step: median {syncs[len(syncs) // 2] * 1e3:.1f} ms, "
              f"max {syncs[-1] * 1e3:.1f} ms over {len(syncs)} steps; vLLM serves version {served}")  # fmt: skip
        engine.shutdown()
        if got != ref_ids or served != str(args.steps):
            sys.exit(f"vllm_rl: FAILED: vLLM served {got} (version {served}), transformers {ref_ids}")
        print("vllm_rl: OK")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
