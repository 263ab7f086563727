"""Mooncake's Transfer Engine as a ``bench put`` baseline, where it is installed.

Written as a Mooncake user writes it: one engine per process over its TCP transport with its
peer-to-peer handshake (no metadata server), memory registered once, then per transfer one
``transfer_sync_write`` (or ``_read``) that returns when the bytes have landed. The reader's engine
listens on the address through which it reaches the store (the cluster link across hosts).
Install: ``pip install mooncake-transfer-engine-non-cuda`` (its engine loads Debian's
``libibverbs1`` and ``libnl-route-3-200`` even for TCP).
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch

from transport.cli.bench._systems import Route, System

#: the baseline's name in reports
MOONCAKE = "mooncake-tcp"
#: the same with a notification on every write (``bench put --notify``), which the reader drains
MOONCAKE_NOTIFY = "mooncake-tcp-notify"


def _engine_class() -> Any:
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines on every connection
    return importlib.import_module("mooncake.engine").TransferEngine


def unavailable() -> str | None:
    """Why the baseline cannot run here (None: it can)."""
    try:
        _engine_class()
    except ImportError as e:
        return (
            f"Mooncake's engine does not load ({e}); pip install "
            "mooncake-transfer-engine-non-cuda, and apt-get install libibverbs1 "
            "libnl-route-3-200"
        )
    return None


def address_toward(peer: str | None) -> str:
    """This host's address on the route to host ``peer`` (127.0.0.1 for a local or no one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer or "127.0.0.1", 9))  # a UDP connect sends nothing: it only picks the route
        addr: str = s.getsockname()[0]
    return addr


class MooncakeEngine:
    """One process's Mooncake engine (TCP, P2P handshake) and the memory it registered. It owns
    the engine; :meth:`session` is the name peers write to."""

    def __init__(self, address: str, memory: Sequence[torch.Tensor]) -> None:
        self.address = address
        self.engine = _engine_class()()
        if self.engine.initialize(address, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's engine did not start on {address}")
        for x in memory:
            if self.engine.register_memory(x.data_ptr(), x.numel() * x.element_size()) != 0:
                raise RuntimeError(f"Mooncake refused to register {x.numel()} elements")

    @property
    def session(self) -> str:
        return f"{self.address}:{self.engine.get_rpc_port()}"

    def drain(self) -> int:
        """Read the notifications that came (the reader's side of a notified write); how many."""
        return len(self.engine.get_notifies())


class Mooncake(System):
    """Each step moves ``local`` (the writer's tensors) to (write) or from (read) the addresses
    ``remote`` of the peer engine ``session``, one synchronous transfer per tensor. With
    ``notify``, each write carries it as Mooncake's notification (``transfer_sync`` with a
    ``TransferNotify``), which the reader drains with ``get_notifies``."""

    family = "mooncake"

    def __init__(
        self,
        engine: MooncakeEngine,
        session: str,
        op: str,
        local: list[torch.Tensor],
        remote: list[int],
        route: Route,
        notify: bytes | None = None,
    ) -> None:
        super().__init__(MOONCAKE if notify is None else MOONCAKE_NOTIFY, route=route)
        self.engine, self.session = engine.engine, session
        self.call = (
            self.engine.transfer_sync_write if op == "write" else self.engine.transfer_sync_read
        )
        if notify is not None:
            if op != "write":
                raise ValueError("Mooncake's notification rides on a write only")
            module = importlib.import_module("mooncake.engine")
            note = module.TransferNotify(engine.session, notify.decode())
            write, sync = module.TransferOpcode.Write, self.engine.transfer_sync
            self.call = lambda session, src, dst, n: sync(session, src, dst, n, write, note)
        self.pairs = [
            (x.data_ptr(), r, x.numel() * x.element_size())
            for x, r in zip(local, remote, strict=True)
        ]

    def step(self) -> None:
        for src, dst, n in self.pairs:
            if self.call(self.session, src, dst, n) != 0:
                raise RuntimeError(f"a Mooncake transfer of {n} bytes to {self.session} failed")
