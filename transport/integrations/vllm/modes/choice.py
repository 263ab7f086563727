"""Which mode a vLLM worker takes, the layout it declares, and why (the worker logs the why)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from transport.integrations.vllm import experts
from transport.integrations.vllm.as_stored import refusals
from transport.integrations.vllm.infos import TransportInitInfo
from transport.integrations.vllm.modes.base import Mode
from transport.integrations.vllm.modes.inplace import InPlace
from transport.integrations.vllm.modes.staged import Staged
from transport.integrations.vllm.modes.streamed import Streamed
from transport.integrations.vllm.room import Room
from transport.integrations.vllm.shards import WorkerLayout, learn, whole


@dataclass(frozen=True)
class Choice:
    """The mode's class, the layout its worker declares, and why that mode."""

    mode: type[Mode]
    layout: WorkerLayout
    why: str


def choose(
    model: torch.nn.Module, info: TransportInitInfo, spec: Mapping[str, torch.Tensor], room: Room
) -> Choice:
    """The mode ``info`` asks for where the model allows it; with ``"auto"``: sharded when one
    staging copy fits within ``room``, else in place where vLLM computes with every parameter as
    stored, else streamed; whole when no parameter maps to the checkpoint. ValueError naming the
    rule when what is asked cannot be."""
    refused = experts.refusals(model)
    if refused:  # no mode helps: every update reloads these layers
        first = "; ".join(f"{n}: {why}" for n, why in list(refused.items())[:2])
        raise ValueError(
            f"transport: {len(refused)} mixture-of-experts layer(s) of this model cannot "
            f"take a weight update exactly, so this worker does not join ({first})"
        )
    asked = ", asked for by init_info mode"
    if info.mode == "whole":
        return Choice(Staged, whole(spec, "asked for by init_info"), asked[2:])
    layout = learn(model, spec)
    if layout.targets:
        mapped = len(spec) - len(layout.fallback)
        why = f"{mapped} of {len(spec)} checkpoint tensors mapped to this worker's parameters"
    elif info.mode in ("sharded", "inplace"):
        raise ValueError(
            f"transport init_info: mode {info.mode!r}, but no parameter of this model could be "
            f"mapped to the checkpoint ({next(iter(layout.fallback.values()), '')}); use mode "
            "'whole' or 'auto'"
        )
    else:
        layout = whole(spec, "nothing mapped")
        why = "no parameter could be mapped, so whole"
    if info.mode == "streamed":
        return Choice(Streamed, layout, why + asked)
    if info.mode != "inplace" and (info.mode != "auto" or layout.nbytes <= room.bound):
        return Choice(Staged, layout, why + ("" if info.mode == "auto" else asked))
    # in place, asked for, or no staging copy fits
    copy = (
        f"one staging copy ({layout.nbytes / 2**30:.3f} GiB) would not fit within "
        f"{room.bound / 2**30:.3f} GiB ({room.how})"
    )
    refused = refusals(model, layout)
    if not refused:
        if info.mode == "inplace":
            return Choice(InPlace, layout, why + asked)
        return Choice(
            InPlace, layout, f"{why}; {copy}, and vLLM computes with every parameter as stored"
        )
    first = ", ".join(f"{n} ({w})" for n, w in list(refused.items())[:4])
    if info.mode == "inplace":
        raise ValueError(
            "transport init_info: this worker cannot receive in place: "
            f"{len(refused)} of its tensors are not used as stored, for example {first}; use "
            "mode 'sharded' (with room for one staging copy) or 'streamed'"
        )
    return Choice(
        Streamed,
        layout,
        f"{why}; {copy}, and it cannot be written in place ({len(refused)} tensors are not "
        f"used as stored, for example {first}): streamed in parts of half of that bound",
    )
