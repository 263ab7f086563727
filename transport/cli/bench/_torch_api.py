"""torch's transport API (PyTorch 2.15) as ``bench put`` systems, where that torch is installed.

* ``torch-nixl``: torch's own NIXL backend, written as its documentation shows:
  ``new_transport("nixl", "cpu")`` with its default options (its progress thread on), one
  endpoint per peer, memory registered once, a descriptor handed over once.
* ``ours-torch-api``: this library through the same API, ``new_transport("transport", "cpu")``.

Each step is one synchronous ``write`` (or ``read``) of a registered view, which returns when
the bytes have landed. Both ends make their endpoints over the memory the other systems use
(the writer's source, the reader's ``buf``), so every system of a configuration moves the same
bytes, and the same checks verify them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from transport.cli.bench._systems import Route, System

TORCH_NIXL = "torch-nixl"
OURS_TORCH = "ours-torch-api"
#: the systems and the backend each is made with
BACKENDS = {TORCH_NIXL: "nixl", OURS_TORCH: "transport"}


def unavailable() -> str | None:
    """Why the systems cannot run here (None: they can)."""
    if importlib.util.find_spec("torch.distributed._transport") is None:
        return (
            f"torch {torch.__version__} has no transport API (torch 2.15 or newer: "
            "bash examples/setup_torch215.sh makes an environment with it)"
        )
    from torch.distributed._transport import available_transports

    missing = [b for b in BACKENDS.values() if b not in available_transports()]
    if missing:
        return f"torch's transport API has no backend {missing[0]!r} here"
    return None


class Endpoints:
    """One process's endpoint of each backend over its memory ``buf`` (registered once in each).
    It owns the endpoints; :meth:`close` closes them."""

    def __init__(self, buf: torch.Tensor) -> None:
        from torch.distributed._transport import new_transport

        self.endpoints: dict[str, Any] = {}
        try:
            for name, backend in BACKENDS.items():
                self.endpoints[name] = new_transport(backend, "cpu")
            self.memory = {n: e.register_memory(buf) for n, e in self.endpoints.items()}
        except BaseException:
            self.close()
            raise

    def urls(self) -> dict[str, bytes]:
        return {n: e.bind() for n, e in self.endpoints.items()}

    def descriptors(self) -> dict[str, bytes]:
        return {n: m.to_remote_buffer().serialize() for n, m in self.memory.items()}

    def connect(self, urls: dict[str, bytes]) -> None:
        for name, endpoint in self.endpoints.items():
            endpoint.connect(urls[name])

    def system(self, name: str, op: str, n: int, remote: bytes, route: Route) -> TorchApi:
        return TorchApi(name, self.endpoints[name], self.memory[name], op, n, remote, route)

    def close(self) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()
        self.endpoints = {}


class TorchApi(System):
    """Each step writes the first ``n`` bytes of the registered memory to the peer's (or reads
    them from it), through ``endpoint``; ``remote`` is the peer's serialized descriptor."""

    family = "torch"

    def __init__(
        self, name: str, endpoint: Any, memory: Any, op: str, n: int, remote: bytes, route: Route
    ) -> None:
        super().__init__(name, route=route)
        # the descriptor class of this backend: the one its own memory describes itself with
        self.remote = type(memory.to_remote_buffer()).deserialize(remote)
        if op == "write":
            self.view, self.call = memory.to_view(0, n), endpoint.write
        else:
            self.view, self.call = memory.to_mutable_view(0, n), endpoint.read

    def step(self) -> None:
        self.call(self.view, self.remote)
