"""What every integration does the same way before its first byte moves: making its Transport
(the secret from the environment, an error that names the store and the setting to check) and,
on a trainer, choosing the publisher of its weight group.

vLLM's trainer and workers, verl's checkpoint engine and the next integration call these, so
that a rule about secrets or publishers changes in one place.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from transport import Transport, TransportError, WeightPublisher
from transport.weights import ShardedPublisher, SourceLayout

#: environment variable holding the namespace secret (never sent through an engine's own APIs)
SECRET_ENV = "TRANSPORT_SECRET"


def secret_env(namespace: str) -> str:
    """The environment variable that holds the secret of ``namespace`` alone:
    ``TRANSPORT_SECRET_`` and the namespace, upper case, other characters than letters and
    digits as ``_`` (``TRANSPORT_SECRET_TENANT_3`` for ``tenant-3``)."""
    return SECRET_ENV + "_" + re.sub(r"[^A-Z0-9]", "_", namespace.upper())


def secret_from_env(namespace: str) -> str | None:
    """The secret of ``namespace``: ``$TRANSPORT_SECRET_<NAMESPACE>`` (:func:`secret_env`:
    one secret per tenant of a shared server), else ``$TRANSPORT_SECRET``; None when neither is
    set."""
    return os.environ.get(secret_env(namespace)) or os.environ.get(SECRET_ENV) or None


def connect(
    name: str,
    *,
    store: str,
    namespace: str,
    timeout: float = 60.0,
    hint: str = "",
) -> Transport:
    """A Transport named ``name`` (at most 128 characters: longer names are cut) in
    ``namespace`` of ``store``, with the namespace's secret from the environment
    (:func:`secret_from_env`). A store it cannot join
    raises the same error type, naming the store and ``hint`` (where the caller's user sets it)."""
    try:
        return Transport(
            name[:128],
            store=store,
            namespace=namespace,
            secret=secret_from_env(namespace),
            timeout=timeout,
        )
    except (TransportError, ValueError, OSError) as e:
        where = f"; {hint}" if hint else ""
        raise type(e)(
            f"{e} ({name[:128]} could not join store {store}, namespace {namespace}{where})"
        ) from e


def choose_publisher(
    transport: Transport,
    tensors: Mapping[str, torch.Tensor],
    *,
    group: str,
    layout: SourceLayout | None = None,
    rank: int = 0,
    fanout: str = "direct",
    degree: int = 2,
    delta: bool | str = False,
) -> WeightPublisher | ShardedPublisher:
    """The publisher of a trainer's weight group. ``layout`` (the same on every rank) makes each
    rank a :class:`~transport.weights.ShardedPublisher` of its own shards; a rank that holds
    every tensor whole publishes the same way with ``fanout="direct"`` (each subscriber is
    written only the part it declared), else through a relay ``fanout`` of ``degree``
    (:class:`~transport.WeightPublisher`: subscribers take tensors whole)."""
    if layout is not None:
        return ShardedPublisher(transport, tensors, layout, rank, group=group, delta=delta)
    if fanout == "direct":
        single = SourceLayout.single(tensors)
        return ShardedPublisher(transport, tensors, single, 0, group=group, delta=delta)
    return WeightPublisher(
        transport, tensors, group=group, fanout=fanout, degree=degree, delta=delta
    )
