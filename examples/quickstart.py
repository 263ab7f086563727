"""Quickstart: two processes on the embedded store.

The receiver exposes a tensor; the writer puts into it (with a notification),
reads it back with a one-sided get, and both sides check every byte.

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys

import torch

import transport

N = 1 << 20  # one million float32: 4 MiB


def receiver(store: str) -> None:
    with transport.Transport("receiver", store=store) as t:
        weights = torch.zeros(N)
        t.expose("weights", weights)  # peers may write and read it
        note = t.wait_notification(timeout=60)  # the writer says when the data has landed
        ok = torch.equal(weights, torch.arange(N, dtype=torch.float32))
        print(
            f"receiver: {note.payload.decode()!r} from {note.peer}; every byte as sent: {ok}",
            flush=True,
        )
        t.wait_notification(timeout=60, peer="writer")  # stay until the writer has read it back
        sys.exit(0 if ok else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--store", default="tcp://127.0.0.1:29517", help="store URL (default: embedded TCPStore)"
    )
    args = ap.parse_args()
    # The first process to open a tcp:// store hosts it: the writer, before it starts the receiver.
    with transport.Transport("writer", store=args.store) as t:
        proc = mp.get_context("spawn").Process(target=receiver, args=(args.store,))
        proc.start()
        t.wait_for_peer("receiver", timeout=60, regions=["weights"])
        src = torch.arange(N, dtype=torch.float32)
        t.put(src, "receiver", "weights", notify=b"step 1").wait(timeout=10)  # one-sided WRITE
        back = torch.zeros(N)
        t.get(back, "receiver", "weights").wait(timeout=10)  # one-sided READ
        same = torch.equal(back, src)
        print(f"writer: put {src.nbytes >> 20} MiB and read it back; identical: {same}", flush=True)
        t.put(src[:1], "receiver", "weights", notify=b"bye").wait(timeout=10)
        proc.join(60)
    ok = same and proc.exitcode == 0
    print("quickstart:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
