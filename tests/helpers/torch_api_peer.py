"""Endpoints of torch's transport API (``new_transport("transport")``) in a child process.

A :class:`TorchApiPeer` holds a list of endpoints, each with one registered byte buffer; the
test binds, connects and hands descriptors between processes as an application would, and
checks what arrived by a SHA-256 of the buffer. Every call has a deadline; nothing here sleeps.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from helpers.child import ChildProcess, serve
from helpers.peer import pattern, sha


def _child(conn: Any, name: str, count: int, nbytes: int, options: dict[str, Any]) -> None:
    from torch.distributed._transport import new_transport

    from transport.integrations.torch_api import RemoteRegion

    try:
        endpoints = [new_transport("transport", "cpu", **options) for _ in range(count)]
        buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
        memories = [e.register_memory(b) for e, b in zip(endpoints, buffers, strict=True)]
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (0, os.getpid())))
    works: dict[int, list[Any]] = {}

    def bind(i: int) -> bytes:
        return endpoints[i].bind()

    def connect(i: int, url: bytes) -> int:
        return endpoints[i].connect(url)

    def describe(i: int) -> bytes:
        return memories[i].to_remote_buffer().serialize()

    def digest(i: int, length: int | None = None) -> str:
        return sha(buffers[i][: nbytes if length is None else length])

    def fill(i: int, seed: int) -> str:
        buffers[i].copy_(pattern(nbytes, seed))
        return sha(buffers[i])

    def write(i: int, remote: bytes, seed: int, length: int, timeout: float) -> str:
        """Write ``length`` bytes of a pattern into the peer's buffer; their digest, or the
        error as 'ErrorType: message'."""
        buffers[i][:length].copy_(pattern(length, seed))
        try:
            endpoints[i].write(
                memories[i].to_view(0, length), RemoteRegion.deserialize(remote), timeout=timeout
            )
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return sha(buffers[i][:length])

    def write_async(i: int, remote: bytes, seed: int, timeout: float) -> str:
        """Start a write of the whole buffer (async_op=True); ``finish`` waits for it."""
        buffers[i].copy_(pattern(nbytes, seed))
        work = endpoints[i].write(
            memories[i].to_view(), RemoteRegion.deserialize(remote), async_op=True, timeout=timeout
        )
        works.setdefault(i, []).append(work)
        return sha(buffers[i])

    def finish(i: int) -> list[str]:
        """Wait for the endpoint's async writes: 'ok' or the error of each."""
        out = []
        for work in works.pop(i, []):
            try:
                work.wait()
                out.append("ok")
            except Exception as e:
                out.append(f"{type(e).__name__}: {e}")
        return out

    def close(i: int, timeout: float) -> str:
        try:
            endpoints[i].close(timeout=timeout)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "closed"

    def pair_rank(port: int, rank: int, peer_rank: int) -> int:
        """One more endpoint, paired with ``peer_rank`` through the TCPStore on ``port``
        (``new_transport_rank``), with a buffer registered; its index."""
        from torch.distributed import TCPStore
        from torch.distributed._transport import new_transport_rank

        store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        endpoint = new_transport_rank(
            "transport", "cpu", store=store, rank=rank, peer_rank=peer_rank, **options
        )
        endpoints.append(endpoint)
        buffers.append(torch.zeros(nbytes, dtype=torch.uint8))
        memories.append(endpoint.register_memory(buffers[-1]))
        return len(endpoints) - 1

    def read(i: int, remote: bytes, timeout: float) -> str:
        """Read the peer's buffer into ours; the digest of what arrived."""
        buffers[i].zero_()
        endpoints[i].read(
            memories[i].to_mutable_view(), RemoteRegion.deserialize(remote), timeout=timeout
        )
        return sha(buffers[i])

    def engines() -> list[str]:
        return [e.engine_name for e in endpoints]

    def threads() -> int:
        return threading.active_count()

    def shutdown() -> None:
        for e in endpoints:
            try:
                e.close(timeout=10)
            except Exception:
                pass

    serve(
        conn,
        {
            "bind": bind,
            "connect": connect,
            "describe": describe,
            "digest": digest,
            "fill": fill,
            "write": write,
            "write_async": write_async,
            "finish": finish,
            "close": close,
            "engines": engines,
            "pair_rank": pair_rank,
            "read": read,
            "threads": threads,
        },
        shutdown,
    )


class TorchApiPeer(ChildProcess):
    """``count`` torch-API endpoints in a child, each with a buffer of ``nbytes`` registered;
    ``options`` go to ``new_transport``."""

    def __init__(
        self,
        name: str,
        count: int = 1,
        nbytes: int = 1 << 20,
        wait: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(name, _child, (count, nbytes, options), start_timeout=120, wait=wait)
