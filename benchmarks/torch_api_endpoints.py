"""What one process pays for endpoints of torch's transport API (torch 2.15): torch's own NIXL
backend against ours (``new_transport("nixl")`` against ``new_transport("transport")``).

For each backend, in a fresh process (the hub) talking to ``--peers`` endpoints of a second
process, each pair connected and a 4 KiB buffer registered and described:

* agents: the distinct NIXL agents behind the hub's endpoints (what their descriptors name: an
  agent for torch's, an engine for ours, whose lane agents are counted besides);
* threads of the hub process, before its endpoints and after;
* idle CPU of the hub (every thread) over ``--idle`` seconds in which it makes no call;
* writer CPU per 4 KiB write (every thread), over ``--writes`` synchronous writes to one peer,
  and their median time; the bytes of the last one are checked at the peer.

    python benchmarks/torch_api_endpoints.py [--peers 8] [--idle 3] [--writes 3000]

Needs torch 2.15 (``bash examples/setup_torch215.sh``, then ``.venv-torch215/bin/python``).
Results are in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

NBYTES = 4096


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _peer(conn: Any, backend: str, count: int) -> None:
    import torch
    from torch.distributed._transport import new_transport

    options = {"shared": False} if backend == "transport" else {}
    endpoints = [new_transport(backend, "cpu", **options) for _ in range(count)]
    buffers = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in range(count)]
    memories = [e.register_memory(b) for e, b in zip(endpoints, buffers, strict=True)]
    conn.send(([e.bind() for e in endpoints], [m.to_remote_buffer().serialize() for m in memories]))
    for endpoint, url in zip(endpoints, conn.recv(), strict=True):
        endpoint.connect(url)
    conn.send("connected")
    conn.recv()  # the hub is done writing
    conn.send(hashlib.sha256(buffers[0].numpy().tobytes()).hexdigest())
    conn.recv()
    for e in endpoints:
        e.close()


def _hub(conn: Any, backend: str, count: int, idle_s: float, writes: int) -> None:
    import torch
    from torch.distributed._transport import new_transport

    threads_before = _threads()
    child, theirs = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=_peer, args=(theirs, backend, count))
    peer.start()
    endpoints = [new_transport(backend, "cpu") for _ in range(count)]
    urls, remotes = child.recv()
    for endpoint, url in zip(endpoints, urls, strict=True):
        endpoint.connect(url)
    child.send([e.bind() for e in endpoints])
    assert child.recv() == "connected"
    sources = [torch.randint(0, 256, (NBYTES,), dtype=torch.uint8) for _ in endpoints]
    memories = [e.register_memory(s) for e, s in zip(endpoints, sources, strict=True)]
    described = [m.to_remote_buffer() for m in memories]
    if backend == "transport":
        agents = len({d.owner for d in described})
        lanes = max(e.engine.lanes for e in endpoints) - 1
        agent_note = (
            f"{agents} engine(s) of 1 agent, and {lanes} lane agent(s) each once it copies "
            "64 MiB or more between host buffers"
        )
    else:
        agents = len({d.agent_name for d in described})
        agent_note = f"{agents} agent(s)"
    remote = [type(described[0]).deserialize(r) for r in remotes]
    threads_after = _threads()

    c0, t0 = time.process_time(), time.monotonic()
    time.sleep(idle_s)
    idle = (time.process_time() - c0) / (time.monotonic() - t0)

    view = memories[0].to_view()
    for _ in range(200):
        endpoints[0].write(view, remote[0])
    times = []
    c0 = time.process_time()
    for _ in range(writes):
        s = time.perf_counter_ns()
        endpoints[0].write(view, remote[0])
        times.append(time.perf_counter_ns() - s)
    cpu_per_write = (time.process_time() - c0) / writes
    child.send("digest")
    ok = child.recv() == hashlib.sha256(sources[0].numpy().tobytes()).hexdigest()
    child.send("bye")
    for e in endpoints:
        e.close()
    peer.join(30)
    conn.send(
        {
            "backend": backend,
            "peers": count,
            "agents": agent_note,
            "threads": f"{threads_before} -> {threads_after}",
            "idle_cpu": f"{100 * idle:.1f}% of a core",
            "cpu_per_write_us": round(1e6 * cpu_per_write, 1),
            "median_write_us": round(statistics.median(times) / 1e3, 1),
            "bytes_checked": ok,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--writes", type=int, default=3000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for backend in ("nixl", "transport"):
        mine, theirs = ctx.Pipe()
        hub = ctx.Process(target=_hub, args=(theirs, backend, args.peers, args.idle, args.writes))
        hub.start()
        print(mine.recv(), flush=True)
        hub.join(60)


if __name__ == "__main__":
    main()
