"""A Transport in a child process, driven over a pipe.

Tests start real peers with :class:`Peer`, tell them what to do, and check
the bytes that arrived by asking the child for a SHA-256 of its regions. Every
call has a deadline; nothing here sleeps.
"""

from __future__ import annotations

import hashlib
import os
import resource
from typing import Any

import torch

from helpers import internals
from helpers.child import START_TIMEOUT, ChildError, ChildProcess, serve

# name -> (dtype, numel, access) or (dtype, numel, access, device), e.g. device "cuda:0"
Regions = dict[str, tuple[Any, ...]]


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """``nbytes`` pseudo-random bytes, the same for the same seed in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().data).hexdigest()


def _child(conn: Any, name: str, store: str, regions: Regions, kwargs: dict[str, Any]) -> None:
    import transport

    try:
        t = transport.Transport(name, store=store, **kwargs)
        bufs = {
            r: torch.zeros(spec[1], dtype=getattr(torch, spec[0]), device=(*spec, "cpu")[3])
            for r, spec in regions.items()
        }
        for access in ("rw", "w", "r"):
            group = {r: bufs[r] for r, spec in regions.items() if spec[2] == access}
            if group:
                t.expose_all(group, access=access)
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def notif_then_sha(timeout: float, names: list[str]) -> tuple[str, bytes, dict[str, str]]:
        n = t.wait_notification(timeout)
        return n.peer, n.payload, {r: sha(bufs[r]) for r in names}

    def put_pattern(
        peer: str, key: str, nbytes: int, seed: int, timeout: float, notify: bytes | None = None
    ) -> str:
        src = pattern(nbytes, seed)
        t.put(src, peer, key, notify=notify).wait(timeout)
        return sha(src)

    loop: dict[str, Any] = {}

    def put_loop_start(peer: str, key: str, nbytes: int, seed: int) -> None:
        """Put a pattern into ``peer``'s ``key`` again and again on a thread, until the first
        error or put_loop_stop."""
        import threading

        src = pattern(nbytes, seed)
        stop = threading.Event()
        out: dict[str, Any] = {"ok": 0, "error": None}

        def run() -> None:
            while not stop.is_set():
                try:
                    t.put(src, peer, key, timeout=30).wait(30)
                except Exception as e:
                    out["error"] = f"{type(e).__name__}: {e}"
                    return
                out["ok"] += 1

        th = threading.Thread(target=run, daemon=True)
        loop.update(stop=stop, out=out, thread=th)
        th.start()

    def put_loop_count() -> int:
        return int(loop["out"]["ok"])

    def put_loop_stop(timeout: float) -> dict[str, Any]:
        loop["stop"].set()
        loop["thread"].join(timeout)
        return dict(loop["out"])

    handlers = {
        "put_loop_start": put_loop_start,
        "put_loop_count": put_loop_count,
        "put_loop_stop": put_loop_stop,
        "sha": lambda r: sha(bufs[r]),
        "shas": lambda names: {r: sha(bufs[r]) for r in names},
        "sha_range": lambda r, start, n: sha(bufs[r].view(torch.uint8)[start : start + n]),
        "read": lambda r, start, n: bytes(
            bufs[r].view(torch.uint8)[start : start + n].cpu().numpy().tobytes()
        ),
        "fill": lambda r, seed: (
            bufs[r].view(torch.uint8).copy_(pattern(bufs[r].nbytes, seed).to(bufs[r].device)),
            sha(bufs[r]),
        )[1],
        "zero": lambda r: bufs[r].zero_() is not None,
        "notif_then_sha": notif_then_sha,
        "notifications": lambda timeout: [(n.peer, n.payload) for n in t.notifications(timeout)],
        "dropped_notifications": lambda: t.dropped_notifications,
        "queued_notifications": lambda: internals.queued_notifications(t),
        "refused_notifications": lambda: t.refused_notifications,
        "notify": lambda peer, payload: t.notify(peer, payload),
        "send_control": lambda peer, channel, payload: t.core.send_control(peer, channel, payload),
        "notification": lambda timeout: (lambda n: (n.peer, n.payload))(
            t.wait_notification(timeout)
        ),
        "put_pattern": put_pattern,
        "wait_for_peer": lambda peer, timeout: t.wait_for_peer(peer, timeout).generation,
        "idle_counts": lambda seconds: internals.idle_counts(t, seconds),
        "doorbell": lambda: internals.doorbell(t),
        "wait_rings": lambda n, timeout: internals.wait_rings(t, n, timeout),
        "max_rss_mib": lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    serve(conn, handlers, t.close)


PeerError = ChildError


class Peer(ChildProcess):
    """A child process running ``Transport(name, store=store_url, **kwargs)`` with ``regions``."""

    def __init__(
        self,
        name: str,
        store_url: str,
        regions: Regions | None = None,
        start_timeout: float = START_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, _child, (store_url, regions or {}, kwargs), start_timeout)


def _cycler_child(conn: Any, name: str, store: str, nbytes: int) -> None:
    """A peer that joins and leaves on command: ``open`` starts a Transport exposing ``buf``,
    ``close`` closes it, ``sha`` hashes ``buf``, ``notification`` returns the next one (or None
    after ``timeout``)."""
    import transport

    state: dict[str, Any] = {}

    def open_() -> int:
        t = transport.Transport(name, store=store)
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        t.expose("buf", buf, access="w")
        state["t"], state["buf"] = t, buf
        return t.generation

    def close() -> None:
        state.pop("t").close()

    conn.send(("ok", (0, os.getpid())))
    serve(
        conn,
        {
            "open": open_,
            "close": close,
            "sha": lambda: sha(state["buf"]),
            "notification": lambda timeout: next(
                ((n.peer, n.payload) for n in state["t"].notifications(timeout)), None
            ),
        },
        lambda: state["t"].close() if "t" in state else None,
    )


class Cycler(ChildProcess):
    """A child process that opens and closes a Transport named ``name`` on command."""

    def __init__(
        self, name: str, store_url: str, nbytes: int, start_timeout: float = START_TIMEOUT
    ) -> None:
        super().__init__(name, _cycler_child, (store_url, nbytes), start_timeout)
