"""GPU figures of stream-ordered transfers (needs a CUDA device and CuPy):

* ``put``: a 1 GiB put between two processes on one GPU (VRAM to VRAM) against a device-to-device
  copy inside one process (``copy_``), both timed with the GPU idle in between;
* ``publish``: a WeightPublisher of 300 tensors to one subscriber process: eager
  ``publish().wait()`` against a captured graph that publishes at every ``replay()``: host time per
  replay (the ``replay()`` call) and step time (replay to synchronize);
* ``torch-transport``: ``torch.distributed._transport``'s ``write_stream``, when this torch has it.

    python benchmarks/gpu_bench.py --json /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

GiB = 1 << 30


def _receiver(store_url: str, nbytes: int, ready: Any, done: Any) -> None:
    import transport

    with transport.Transport("gpu-recv", store=store_url) as t:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        t.expose("buf", buf, access="w")
        ready.set()
        done.wait(600)


def _subscriber(store_url: str, layout: list[int], ready: Any, done: Any) -> None:
    import transport

    with transport.Transport("gpu-gen", store=store_url) as t:
        live = {f"w{i}": torch.zeros(n, device="cuda") for i, n in enumerate(layout)}
        sub = transport.WeightSubscriber(t, live, mode="inplace")
        ready.set()
        done.wait(600)
        sub.close()


@contextmanager
def _peer(target: Callable[..., None], *args: Any) -> Iterator[None]:
    """``target(*args, ready, done)`` in a spawned process, ready on entry, told to end on exit."""
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready, done))
    proc.start()
    try:
        assert ready.wait(120), f"{target.__name__} did not start"
        yield
    finally:
        done.set()
        proc.join(60)


def bench_put(store_url: str, nbytes: int, iters: int) -> dict[str, Any]:
    import transport

    with _peer(_receiver, store_url, nbytes):
        with transport.Transport("gpu-send", store=store_url) as t:
            t.wait_for_peer("gpu-recv", 60)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            put_s, copy_s = [], []
            t.put(src, "gpu-recv", "buf").wait(60)  # connect, register
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                t.put(src, "gpu-recv", "buf").wait(60)
                put_s.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize()
                copy_s.append(time.perf_counter() - t0)
        put, copy = statistics.median(put_s), statistics.median(copy_s)
        return {
            "bytes": nbytes,
            "put_s": put,
            "d2d_copy_s": copy,
            "put_gbps": nbytes / put / 1e9,
            "copy_gbps": nbytes / copy / 1e9,
            "put_over_copy_bandwidth": copy / put,
            "target": 0.7,
        }


def bench_publish(store_url: str, tensors: int, params: int, iters: int) -> dict[str, Any]:
    import transport

    layout = [params // tensors] * tensors
    with _peer(_subscriber, store_url, layout):
        with transport.Transport("gpu-trainer", store=store_url) as t:
            step = torch.zeros(1, device="cuda")
            weights = {f"w{i}": torch.zeros(n, device="cuda") for i, n in enumerate(layout)}
            pub = transport.WeightPublisher(t, weights)
            end = time.monotonic() + 60
            while not pub.subscribers() and time.monotonic() < end:
                pub.refresh()
                t.wait_for_peer("gpu-gen", 1)

            def update() -> None:
                for w in weights.values():
                    w.add_(step)

            eager = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                update()
                torch.cuda.synchronize()
                r = pub.publish().wait(60)
                eager.append(time.perf_counter() - t0)
                assert r.done == ["gpu-gen"], r.reasons
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                update()
            s.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                update()
                pub.publish(stream=s, timeout=60).wait_stream(s)
            host, steps = [], []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                g.replay()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                t.check()
                host.append(t1 - t0)
                steps.append(t2 - t0)
            # every replay published a version of its own (a graph that replays without
            # sending would time nothing)
            assert pub.version == 2 * iters, f"{iters} replays published {pub.version - iters}"
            pub.close()
        e, st, h = statistics.median(eager), statistics.median(steps), statistics.median(host)
        return {
            "tensors": tensors,
            "bytes": params * 4,
            "eager_step_s": e,
            "graph_step_s": st,
            "graph_host_s": h,
            "graph_over_eager_step": st / e,
            "host_target_s": 30e-6,
            "step_target": 1.1,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="tcp://127.0.0.1:29531")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transport.cuda.stream import unavailable

    why = unavailable()
    if why:
        print(f"gpu_bench: {why}", file=sys.stderr)
        return 2
    from transport.store.tcp import TcpStore

    host, port = args.store.removeprefix("tcp://").rsplit(":", 1)
    store = TcpStore(host, int(port), hosting="yes")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        out["put"] = bench_put(args.store, GiB, args.iters)
        print(
            f"1 GiB put between two processes: {out['put']['put_gbps']:.1f} GB/s; "
            f"device copy {out['put']['copy_gbps']:.1f} GB/s; ratio "
            f"{out['put']['put_over_copy_bandwidth']:.2f} (target >= 0.7)",
            flush=True,
        )
        out["publish"] = bench_publish(args.store, 300, 64 << 20, args.iters)
        p = out["publish"]
        print(
            f"publish of 300 tensors: eager step {p['eager_step_s'] * 1e3:.2f} ms, graph step "
            f"{p['graph_step_s'] * 1e3:.2f} ms ({p['graph_over_eager_step']:.2f}x, target <= 1.1); "
            f"host time per replay {p['graph_host_s'] * 1e6:.1f} us (target <= 30)",
            flush=True,
        )
        # a submodule is an attribute only once imported: ask the import system
        present = importlib.util.find_spec("torch.distributed._transport") is not None
        out["torch_transport"] = (
            "present: compare write_stream by hand" if present else "absent in this torch"
        )
        print(f"torch.distributed._transport: {out['torch_transport']}")
    finally:
        store.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
