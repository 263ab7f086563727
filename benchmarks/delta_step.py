"""How much of a model changes in one RL step, and what sending only the changes costs.

A small Llama (transformers) is trained a few steps with AdamW at the learning rates RL uses, its
master weights in float32 and the weights a generator serves in bfloat16, as trainers keep them.
After each step the bfloat16 weights are compared with the step before, bit for bit, and the
changes encoded as ``WeightPublisher(delta=True)`` sends them (transport/weights/delta/codec.py).
Printed per learning rate: the share of bfloat16 elements that changed, the bytes of our encoding
and of verl's (an int32 position and a bfloat16 value per change) against the whole model, and
the time to diff and to apply on this machine's CPU.

    python benchmarks/delta_step.py [--steps 6] [--lrs 1e-6,1e-5] [--hidden 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transport.weights.delta.codec import DeltaLayout, encode
from transport.weights.delta.decoder import apply, decode


def llama(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),  # grouped-query attention
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def measure(lr: float, steps: int, hidden: int, layers: int, vocab: int) -> dict[str, float]:
    model = llama(hidden, layers, vocab)  # float32: the master weights
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)

    def served() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}

    def train_step() -> None:
        tokens = torch.randint(0, vocab, (4, 128), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    train_step()  # past Adam's first step, whose update is lr * sign(g) everywhere
    before = served()
    layout = DeltaLayout({n: before[n] for n in sorted(before)})
    base = {n: t.clone() for n, t in before.items()}
    shares, ours, verl, diff_s, apply_s = [], [], [], [], []
    for _ in range(steps):
        train_step()
        now = served()
        t0 = time.perf_counter()
        enc = encode(layout, now, base, 1, 0)  # base becomes now
        diff_s.append(time.perf_counter() - t0)
        assert enc is not None
        target = {n: t.clone() for n, t in before.items()}
        t0 = time.perf_counter()
        apply(decode(layout, enc.blob, 1, 0), target)
        apply_s.append(time.perf_counter() - t0)
        assert all(torch.equal(target[n].view(torch.int16), now[n].view(torch.int16)) for n in now)
        shares.append(enc.changed / enc.elements)
        ours.append(enc.blob.numel() / layout.nbytes)
        verl.append(enc.changed * (4 + 2) / layout.nbytes)
        before = now
    return {
        "params": sum(t.numel() for t in before.values()),
        "changed": statistics.median(shares),
        "ours": statistics.median(ours),
        "verl": statistics.median(verl),
        "diff_ms": statistics.median(diff_s) * 1e3,
        "apply_ms": statistics.median(apply_s) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lrs", default="1e-6,1e-5")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    print(
        f"{'lr':>8} {'params':>10} {'changed':>8} {'ours/full':>10} {'verl/full':>10} "
        f"{'ours/verl':>10} {'diff ms':>8} {'apply ms':>9}"
    )
    for lr in (float(x) for x in a.lrs.split(",")):
        r = measure(lr, a.steps, a.hidden, a.layers, a.vocab)
        print(
            f"{lr:>8.0e} {r['params']:>10.0f} {r['changed']:>8.2%} {r['ours']:>10.4f} "
            f"{r['verl']:>10.4f} {r['ours'] / r['verl']:>10.2f} {r['diff_ms']:>8.1f} "
            f"{r['apply_ms']:>9.1f}"
        )


if __name__ == "__main__":
    main()
