"""The trainer and the generators of the hosts tests (marker hosts), each in a host of a cluster
(transport/cluster/), driven over stdin and stdout one JSON line per command: a generator ``V`` (wait for version V,
apply it, answer what the live tensors hold), the trainer ``V DEADLINE`` (publish V; ``0 0``
waits for the generators to join) or ``suspect NAME`` (why it takes that peer for gone, and the
wall time of its last heartbeat).

Every element of every tensor of version ``v`` holds ``v``: a generator's per-tensor
(smallest, largest) of ``(v, v)`` means every byte of ``v`` arrived."""

from __future__ import annotations

import json
from typing import Any

from helpers.processes import PythonProcess
from transport.cluster import Cluster, Host

MiB = 1 << 20

GENERATOR = r"""
import json, sys, torch, transport
store, name, tensors, numel = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = transport.Transport(name, store=store, timeout=30)
sub = transport.WeightSubscriber(
    t, {f"w{i}": torch.zeros(numel) for i in range(tensors)}, group="hosts")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    v = int(line)
    sub.wait_for_version(v, 120)
    sub.apply()
    print(json.dumps({"v": sub.applied_version, "ext": {n: [float(x.min()), float(x.max())]
                                                      for n, x in sub.live.items()}}), flush=True)
"""

TRAINER = r"""
import json, sys, time, torch, transport
store, tensors, numel, gens, fanout = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                       int(sys.argv[4]), sys.argv[5])
t = transport.Transport("trainer", store=store, timeout=30)
state = {f"w{i}": torch.zeros(numel) for i in range(tensors)}
pub = transport.WeightPublisher(t, state, group="hosts", fanout=fanout)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    v, arg = line.split()
    if v == "suspect":  # why the trainer takes generator ARG for gone (null: it does not)
        info = {p.name: p for p in t.peers()}.get(arg)
        why = "it has no record" if info is None else info.suspect
        print(json.dumps({"suspect": why, "beat": info and info.last_heartbeat}), flush=True)
        continue
    v, timeout = int(v), float(arg)
    if v == 0:  # wait for the generators to join
        while len(pub.subscribers()) < gens:
            pub.refresh()
        print(json.dumps({"subscribers": pub.subscribers()}), flush=True)
        continue
    for x in state.values():
        x.fill_(v)
    t0 = time.monotonic()
    r = pub.publish(v, timeout=timeout).wait(timeout + 60)
    print(json.dumps({"v": v, "status": dict(r.status), "reasons": dict(r.reasons),
                      "s": time.monotonic() - t0}), flush=True)
"""


def start(cluster: Cluster, host: Host, code: str, *args: str) -> PythonProcess:
    """``code`` in ``host``, UCX kept to TCP over its link; ``close`` of the cluster kills it."""
    return PythonProcess(
        code,
        *args,
        prefix=tuple(host.command([])),
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"},
    )


def ask(proc: PythonProcess, line: str, timeout: float = 180) -> dict[str, Any]:
    """Send one command line; its JSON answer."""
    assert proc.proc.stdin is not None
    proc.proc.stdin.write(line + "\n")
    proc.proc.stdin.flush()
    answer: dict[str, Any] = json.loads(proc.expect_line(timeout))
    return answer


def whole(v: int, tensors: int) -> dict[str, Any]:
    """A generator's answer when it holds every byte of version ``v``."""
    return {"v": v, "ext": {f"w{i}": [v, v] for i in range(tensors)}}
