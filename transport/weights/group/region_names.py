"""The names of a group's regions (each subscriber's slots, the publisher's, the marks a record
carries), its control channel (and telling a peer's newest incarnation on it), and the checks of
the tensors a publisher or subscriber holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from transport import PeerLostError
from transport.contract import check_tensor, dtype_name

MODES = ("staging", "inplace")

#: the publisher's own regions (read-only, for late joiners): "<group>@pub/<name>" and the
#: sequence word "<group>@pub/__seq" = [seq (odd while the trainer changes the tensors), version]
PUB_SLOT = "pub"
SEQ_NAME = "__seq"


def check_named_tensors(named: Mapping[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """The tensors of a publisher or subscriber, checked before anything is registered (a
    subscriber's may be meta tensors: shapes and dtypes, whose staging lives elsewhere)."""
    if not named:
        raise ValueError(f"a {role} needs at least one tensor")
    for name, t in named.items():
        if role == "subscriber" and isinstance(t, torch.Tensor) and t.is_meta:
            check_tensor(torch.empty(0, dtype=t.dtype), f"tensor {name!r}")
            continue
        check_tensor(t, f"tensor {name!r}")
    return dict(named)


def match_regions(
    regions: Mapping[str, Any], group: str, tensors: Mapping[str, torch.Tensor], role: str
) -> tuple[list[str], list[str]]:
    """The names of a subscriber's slot-0 regions of ``group`` that ``tensors`` can fill, and
    one problem per region they cannot (missing, or another shape or dtype); ``role`` names the
    side that holds ``tensors`` in the messages."""
    prefix, names, problems = region(group, 0, ""), [], []
    for rname, info in regions.items():
        if not rname.startswith(prefix):
            continue
        n = rname[len(prefix) :]
        t = tensors.get(n)
        if t is None:
            problems.append(f"{n!r}: the {role} has no tensor of that name")
        elif tuple(t.shape) != info.shape or dtype_name(t.dtype) != info.dtype:
            problems.append(
                f"{n!r}: {role} {tuple(t.shape)} {dtype_name(t.dtype)}, subscriber {info.shape} {info.dtype}"
            )
        else:
            names.append(n)
    return names, problems


def exposed_slots(regions: Mapping[str, Any], group: str) -> int:
    """How many slots of ``group`` a subscriber's regions hold (slot 0, then 0 and 1, ...)."""
    head, seen = region(group, "", "")[:-1], set()  # "<group>@", then the slot, then "/"
    for r in regions:
        if r.startswith(head):
            seen.add(r[len(head) :].partition("/")[0])
    slots = 0
    while str(slots) in seen:
        slots += 1
    return slots


def inplace_mark(group: str) -> str:
    """The region an in-place subscriber of ``group`` exposes (one byte nobody reads) to say so
    in its own record: a publisher writes a member in place only when its record has it, so a
    store writer cannot have a staging subscriber's slot written in place by rewriting its
    group entry (it would have to take over the subscriber's record too)."""
    return region(group, "mode", "inplace")


def slot_regions(
    group: str, slots: list[dict[str, torch.Tensor]], mode: str
) -> dict[str, torch.Tensor]:
    """The regions a subscriber of ``group`` exposes: each tensor of each slot, and, when its
    entry says ``mode`` "inplace", the mark that its own record says so too."""
    out = {region(group, k, n): t for k, slot in enumerate(slots) for n, t in slot.items()}
    if mode == "inplace":
        out[inplace_mark(group)] = torch.zeros(1, dtype=torch.uint8)
    return out


def rank_mark(group: str, rank: int, world: int) -> str:
    """The region a sharded trainer's rank exposes (one byte nobody reads) to say in its own
    record which rank of how many it publishes: a subscriber takes the number of ranks whose
    parts make a version from the records of the ranks it hears, so a store writer cannot make
    it complete a version with fewer ranks' parts by rewriting leases (it would have to take
    over the ranks' records too)."""
    return region(group, "rank", f"{rank}-of-{world}")


def marked_rank(regions: Mapping[str, Any], group: str) -> tuple[int, int] | None:
    """(rank, world) as a record's :func:`rank_mark` says (the largest world if it lists
    several: a leftover of an earlier rank of this Transport); None if it has none."""
    prefix, found = region(group, "rank", ""), None
    for name in regions:
        if not name.startswith(prefix):
            continue
        rank, sep, world = name[len(prefix) :].partition("-of-")
        if not (sep and rank.isascii() and rank.isdigit() and world.isascii() and world.isdigit()):
            continue
        mark = (int(rank), int(world))
        if found is None or mark[1] > found[1]:
            found = mark
    return found


def inbox_region(group: str) -> str:
    """The region where a subscriber of ``group`` takes deltas (weights/delta/): bytes that a
    publisher writes and the subscriber applies onto a slot."""
    return region(group, "delta", "inbox")


def channel(group: str) -> str:
    return f"ws/{group}"


def tell_newest(transport: Any, peer: str, group: str, payload: bytes) -> None:
    """Send ``payload`` on ``group``'s channel to the newest incarnation of ``peer``: when the
    connection held is found lost (the peer restarted before this side noticed), the peer is
    looked up afresh and told once more. Only for a message that vouches for nothing this side
    wrote to the incarnation before (an answer to the peer's own message, the first message of
    a write that the new incarnation was planned for): a bare message fails on a restarted
    peer otherwise, as ``Transport.notify`` does."""
    try:
        transport.core.send_control(peer, channel(group), payload)
    except PeerLostError:
        transport.core.peer(peer, refresh=True)
        transport.core.send_control(peer, channel(group), payload)


def region(group: str, slot: int | str, name: str) -> str:
    return f"{group}@{slot}/{name}"
