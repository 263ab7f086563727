"""The main job: a trainer pushes fresh weights to generator processes after every step.

The trainer hosts the embedded store (no server to run), starts the
generators, and after each "training step" writes its whole state dict into
every generator with one batched put per generator (a fan-out, one handle),
followed by a notification naming the step. Each generator checks every byte
of every tensor against the step it was told about and acknowledges it with a
put of its own into the trainer; the trainer starts the next step once every
generator has acknowledged. At the end it prints a short report.

    python examples/push_weights.py [--generators 2] [--steps 10] [--params 25e6] [--tensors 100]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

import transport


def shapes(params: int, tensors: int) -> dict[str, tuple[int, ...]]:
    """A synthetic model: ``tensors`` weight matrices of about ``params`` parameters in all."""
    per = max(1, params // tensors)
    cols = 1024
    return {f"layers.{i}.weight": (max(1, per // cols), cols) for i in range(tensors)}


def base_weights(spec: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {k: torch.randint(0, 1000, s, generator=g).float() for k, s in spec.items()}


def generator(name: str, store: str, spec: dict[str, tuple[int, ...]], reports: mp.Queue) -> None:
    with transport.Transport(name, store=store) as t:
        live = {k: torch.zeros(s) for k, s in spec.items()}
        t.expose_all(live, access="w")
        base = base_weights(spec)
        index = int(name.split("-")[1])
        ack = torch.zeros(1, dtype=torch.int64)
        checked, bad = 0, 0
        while True:
            note = t.wait_notification(timeout=120, peer="trainer")
            if note.payload == b"stop":
                break
            step = int(note.payload)
            # every byte of every tensor must be this step's weights
            ok = all(torch.equal(live[k], base[k] + step) for k in spec)
            checked += 1
            bad += not ok
            # tell the trainer this step is consumed: a put into its "acks" region, with a notification
            ack[0] = step
            t.put(ack, "trainer", "acks", offset=index, notify=b"ack").wait(timeout=60)
        reports.put((name, checked, bad))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--params", type=float, default=25e6, help="parameters in the model (float32)")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument(
        "--store", default="tcp://127.0.0.1:29517", help="store URL (default: the embedded one)"
    )
    args = ap.parse_args()
    if args.generators < 1 or args.steps < 1 or args.tensors < 1 or args.params < args.tensors:
        ap.error(
            "--generators, --steps and --tensors must be at least 1, and --params at least --tensors"
        )
    spec = shapes(int(args.params), args.tensors)
    names = [f"gen-{i}" for i in range(args.generators)]
    ctx = mp.get_context("spawn")
    reports: mp.Queue = ctx.Queue()
    with transport.Transport("trainer", store=args.store) as t:  # hosts the embedded store
        acks = torch.zeros(len(names), dtype=torch.int64)
        t.expose("acks", acks, access="w")
        procs = [ctx.Process(target=generator, args=(n, args.store, spec, reports)) for n in names]
        for p in procs:
            p.start()
        for n in names:
            t.wait_for_peer(n, timeout=120, regions=list(spec))
        weights = base_weights(spec)
        base = {k: v.clone() for k, v in weights.items()}
        nbytes = sum(v.nbytes for v in weights.values())
        times = []
        for step in range(1, args.steps + 1):
            for k in weights:  # the "training step": new weights
                torch.add(base[k], step, out=weights[k])
            t0 = time.perf_counter()
            t.put(weights, names, notify=str(step).encode()).wait(timeout=120)
            times.append(time.perf_counter() - t0)
            for _ in names:  # generators verify, then ack; the next step waits for every ack
                t.wait_notification(timeout=120)
            assert acks.tolist() == [step] * len(names), acks.tolist()
        t.put(
            {spec_key: weights[spec_key] for spec_key in list(spec)[:1]}, names, notify=b"stop"
        ).wait(60)
        results = [reports.get(timeout=120) for _ in names]
        for p in procs:
            p.join(60)
    med = statistics.median(times)
    verified = sum(r[1] for r in results)
    bad = sum(r[2] for r in results)
    print(
        f"pushed {len(spec)} tensors, {nbytes / 2**20:.0f} MiB per generator, to {len(names)} generators, "
        f"{args.steps} steps"
    )
    print(
        f"step time median {med * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms; "
        f"{nbytes * len(names) / med / 1e9:.2f} GB/s delivered in all"
    )
    print(
        f"generators verified {verified} of {args.steps * len(names)} updates, every byte; mismatches: {bad}"
    )
    ok = bad == 0 and verified == args.steps * len(names) and all(p.exitcode == 0 for p in procs)
    print("push_weights:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
