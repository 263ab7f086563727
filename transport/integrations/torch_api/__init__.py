"""torch's transport API (``torch.distributed._transport``, PyTorch 2.15) on this library.

``new_transport("transport")`` (found through the ``torch.distributed.transports`` entry point
this package installs) returns a :class:`~transport.integrations.torch_api.endpoint.TorchTransport`:
torch's endpoint, one peer each, on this library's engine. What differs from torch's NIXL
backend is said in its docstring: one agent per process however many endpoints, no spinning
progress thread, deadlines that withdraw a transfer, sealed URLs and descriptors with a secret.

The rooms: ``endpoint.py`` (the endpoint), ``engines.py`` (the engines its endpoints share),
``memory.py`` (registrations and views), ``descriptors.py`` (the URL and descriptor bytes),
``work.py`` (``torch.distributed.Work`` over our handles).

torch 2.13 and 2.14 have no transport API: there this package imports, and only the endpoint
is missing (with the line that says so).
"""

from __future__ import annotations

from typing import Any

try:
    import torch.distributed._transport  # noqa: F401
except ImportError as e:
    _MISSING: ImportError | None = e
else:
    _MISSING = None
    from transport.integrations.torch_api.endpoint import TorchTransport  # noqa: F401

from transport.integrations.torch_api.descriptors import EndpointUrl, RemoteRegion

__all__ = ["EndpointUrl", "RemoteRegion", "TorchTransport"]


def __getattr__(name: str) -> Any:
    if name == "TorchTransport" and _MISSING is not None:
        import torch

        raise ImportError(
            f"torch's transport API needs torch 2.15 or newer; this is torch {torch.__version__} "
            f"({_MISSING})"
        )
    raise AttributeError(name)
