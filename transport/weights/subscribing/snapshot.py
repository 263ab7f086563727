"""The Snapshot a WeightSubscriber hands out, and the check of what it is given (before it holds
anything)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from transport.weights.group.region_names import MODES, check_named_tensors
from transport.weights.layouts import DestTensor, check_dest
from transport.weights.layouts.encoding import encode_dest


@dataclass(frozen=True)
class Snapshot:
    """A complete version held for reading (:meth:`WeightSubscriber.read`): ``tensors`` are views
    of the staging slot that holds ``version``; no writer touches them until the read ends."""

    version: int
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Given:
    """A subscriber's arguments once checked: its ``live`` tensors, its declared ``layout``,
    whether it has only shapes (``spec_only``: meta tensors), its slot count, and the layout as
    it is declared in the store."""

    live: dict[str, torch.Tensor]
    layout: dict[str, DestTensor] | None
    spec_only: bool
    slots: int
    #: the declared layout as the store holds it (with the source shapes it expects)
    declared: bytes | None


def check_given(
    named_tensors: Mapping[str, torch.Tensor],
    mode: str,
    slots: int,
    relay: object,
    staging_device: object,
    layout: Mapping[str, DestTensor] | None,
    source_shapes: Mapping[str, Sequence[int]] | None,
) -> Given:
    """The checked arguments, or ValueError / TypeError naming the rule."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if slots not in (1, 2) or (mode == "inplace" and slots != 2):
        raise ValueError(f"slots is 2 or 1 (staging mode only), got {slots!r}")
    if not isinstance(relay, bool):
        raise TypeError(f"relay must be a bool, got {type(relay).__name__}")
    live = check_named_tensors(named_tensors, "subscriber")
    spec_only = any(t.is_meta for t in live.values())
    if spec_only and (mode != "staging" or staging_device is None):
        raise ValueError(
            "meta tensors (shapes and dtypes only) need mode='staging' and a staging_device "
            "where the versions land; give real tensors for mode='inplace'"
        )
    if spec_only and not all(t.is_meta for t in live.values()):
        raise ValueError("named_tensors mixes meta tensors with real ones: give one kind")
    dest = None if layout is None else check_dest(layout, live)
    shapes = {n: tuple(int(k) for k in v) for n, v in (source_shapes or {}).items()}
    declared = None if dest is None else encode_dest(dest, shapes)
    return Given(live, dest, spec_only, slots if mode == "staging" else 1, declared)
