"""The doctor's loopback probe: a reader and a writer, each a process of its own on this host, on
the doctor's store in a namespace of their own. The writer runs with ``UCX_PROTO_INFO=y``, so
UCX prints the protocol it chose for each operation; it times puts and copies and prints its
figures as one line marked ``RESULT_MARK``. The reader's ready line carries a CMA identity
(backends/cma.py) for the doctor to prove, as a writer's backend would. Run by ``transport doctor``; ``python -m
transport.cli.doctor.probe --role reader|writer --store URL --namespace NS`` runs one side."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict

from transport.cli.doctor.report import Loopback
from transport.cli.doctor.routes import RESULT_MARK

READER, WRITER = "doctor-reader", "doctor-writer"
SMALL, BIG = 4096, 64 << 20


def _median_s(fn: object, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reader(store: str, namespace: str) -> None:
    import torch

    import transport
    from transport.backends.cma import CmaPeers

    gate = CmaPeers()  # the identity a Transport's backend shows its peers (the doctor proves it)
    with transport.Transport(READER, store, namespace=namespace) as t:
        t.expose("small", torch.zeros(SMALL, dtype=torch.uint8), access="rw")
        t.expose("big", torch.zeros(BIG, dtype=torch.uint8), access="w")
        print("ready", gate.header().hex(), flush=True)
        sys.stdin.readline()
    gate.close()


def _writer(store: str, namespace: str, timeout: float) -> None:
    import torch

    import transport

    with transport.Transport(WRITER, store, namespace=namespace) as t:
        t.wait_for_peer(READER, timeout)
        small, big = torch.ones(SMALL, dtype=torch.uint8), torch.ones(BIG, dtype=torch.uint8)
        into = torch.empty_like(small)
        t.put(small, READER, "small", notify=b"doctor").wait(timeout)  # connects
        t.get(into, READER, "small").wait(timeout)
        put_small = _median_s(lambda: t.put(small, READER, "small").wait(timeout), 300)
        t.put(big, READER, "big").wait(timeout)
        put_big = _median_s(lambda: t.put(big, READER, "big").wait(timeout), 5)
        copy_small = _median_s(lambda: into.copy_(small), 300)
        copy_dst = torch.empty_like(big)
        copy_dst.copy_(big)
        copy_big = _median_s(lambda: copy_dst.copy_(big), 5)
        result = Loopback(
            put_4k_us=put_small * 1e6,
            memcpy_4k_us=copy_small * 1e6,
            put_64m_gbps=BIG / put_big / 1e9,
            memcpy_64m_gbps=BIG / copy_big / 1e9,
        )
    print(RESULT_MARK + json.dumps(asdict(result)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("reader", "writer"), required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    if args.role == "reader":
        _reader(args.store, args.namespace)
    else:
        _writer(args.store, args.namespace, args.timeout)


if __name__ == "__main__":
    main()
