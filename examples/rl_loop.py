"""An RL-style loop: a trainer trains a small transformer and publishes its weights after every
step; generator processes sample tokens with the newest complete version they hold.

The trainer hosts the embedded store (or pass --store redis://...). Generators are
WeightSubscribers in staging mode: a publish lands in a staging copy, and each generator
applies the newest complete version between two samples, so a sample never mixes versions.
Every version carries a checksum of the trainer's weights; a generator checks it whenever it
applies a version. At the end the trainer prints a short report.

    python examples/rl_loop.py [--steps 20] [--generators 2] [--store URL]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import time

import torch
from torch import nn

import transport

VOCAB, DIM, SEQ = 64, 64, 32


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(
            DIM, nhead=4, dim_feedforward=4 * DIM, batch_first=True, dropout=0.0
        )
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.head(self.body(self.emb(x) + self.pos[:n], mask=mask, is_causal=True))


def checksum(sd: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in sd.values()))


def batch(g: torch.Generator, n: int = 16) -> torch.Tensor:
    """A toy task: sequences that count up modulo VOCAB from a random start."""
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def generator(name: str, store: str, reports: mp.Queue) -> None:
    torch.manual_seed(hash(name) % 1000)  # its own random weights until the first version lands
    model = TinyLM().eval()
    with transport.Transport(name, store=store) as t:
        sub = transport.WeightSubscriber(t, model.state_dict(), group="policy", mode="staging")
        sums: dict[int, float] = {}
        used: list[int] = []
        bad = 0
        sub.wait_for_version(1, timeout=120)
        stopping = False
        while True:
            for n in t.notifications(timeout=0):  # checksums and the stop signal from the trainer
                kind, _, rest = n.payload.decode().partition(":")
                if kind == "stop":
                    stopping = True  # after one last sample with the final version
                    continue
                v, s = rest.split(":")
                sums[int(v)] = float(s)
            version = sub.apply()  # the newest complete version, between two samples
            if version in sums and abs(checksum(model.state_dict()) - sums.pop(version)) > 1e-6:
                bad += 1
            with torch.no_grad():
                seq = torch.tensor([[version % VOCAB]])
                for _ in range(8):
                    seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
            used.append(version)
            print(f"{name}: version {version:3d} sampled {seq[0].tolist()}", flush=True)
            if stopping:
                reports.put((name, used, bad))
                sub.close()
                return
            with contextlib.suppress(transport.TransferTimeout):  # the next version, or a moment
                sub.wait_for_version(version + 1, timeout=0.2)  # to look at notifications again


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument(
        "--store",
        default="tcp://127.0.0.1:29517",
        help="store URL: the embedded one, or redis://...",
    )
    ap.add_argument(
        "--fanout",
        choices=("direct", "chain", "tree"),
        default="direct",
        help="who writes each generator: the trainer (direct), or generators relaying (chain, tree)",
    )
    args = ap.parse_args()
    if args.steps < 1 or args.generators < 1:
        ap.error("--steps and --generators must be at least 1")
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    names = [f"gen-{i}" for i in range(args.generators)]
    ctx = mp.get_context("spawn")
    reports: mp.Queue = ctx.Queue()
    with transport.Transport("trainer", store=args.store) as t:
        pub = transport.WeightPublisher(t, model.state_dict(), group="policy", fanout=args.fanout)
        procs = [ctx.Process(target=generator, args=(n, args.store, reports)) for n in names]
        for p in procs:
            p.start()
        for n in names:
            t.wait_for_peer(n, timeout=120)
        while len(pub.subscribers()) < len(names):
            pub.refresh()
            t.wait_for_peer(names[0], timeout=1)  # a cheap bounded pause while generators join
        publish_ms, losses = [], []
        for step in range(1, args.steps + 1):
            x = batch(g)
            loss = nn.functional.cross_entropy(
                model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            t0 = time.perf_counter()
            result = pub.publish(step, timeout=30).wait(60)
            publish_ms.append(1e3 * (time.perf_counter() - t0))
            s = checksum(model.state_dict())
            for n in names:
                t.notify(n, f"sum:{step}:{s!r}".encode())
            if result.excluded or result.lost:
                print(
                    f"trainer: step {step}: excluded {result.excluded} lost {result.lost} {result.reasons}"
                )
        for n in names:
            t.notify(n, b"stop:")
        results = [reports.get(timeout=120) for _ in names]
        for p in procs:
            p.join(60)
        pub.close()
    nbytes = sum(v.nbytes for v in model.state_dict().values())
    print(
        f"trainer: {args.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
        f"{len(model.state_dict())} tensors, {nbytes / 2**20:.1f} MiB per publish to {len(names)} generators "
        f"({args.fanout}); "
        f"publish median {statistics.median(publish_ms):.2f} ms"
    )
    ok = all(p.exitcode == 0 for p in procs)
    for name, used, bad in results:
        print(
            f"{name}: {len(used)} samples, versions {used[0]}..{used[-1]}, checksum mismatches {bad}"
        )
        ok = ok and bad == 0 and used == sorted(used) and used[-1] >= 1
    print("rl_loop:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
