"""The publisher's side of a group's membership: its view of each subscriber, and the fan-outs."""

from __future__ import annotations

import time

import torch

from transport.weights._delivery import Delivery
from transport.weights._messages import MAX_DEGREE


class Member:
    """The publisher's view of one subscriber incarnation: what it takes (``names``, the
    ``batches`` per slot), what went wrong with it (``error``; ``transient`` if planning it again
    may help), its free slots (``credits``), the slot being written and by whom, the version
    waiting for a slot, and the segments of a version in flight. The publisher changes it under
    its own lock only."""

    def __init__(self, name: str, generation: int, mode: str, slots: int, relay: bool) -> None:
        self.name, self.generation, self.mode, self.slots = name, generation, mode, slots
        self.can_relay = relay and mode == "staging"
        self.names: frozenset[str] = frozenset()
        self.batches: list[dict[str, torch.Tensor]] = []
        self.error = ""
        self.transient = False  # the error may pass (connecting failed): planned again next time
        self.asked = time.monotonic()  # when we last said hello (asked for free slots)
        self.credits: set[int] = set(range(slots)) if mode == "inplace" else set()
        self.completed = -1  # the newest version that landed there
        self.busy: int | None = None  # slot being written
        self.writing = -1  # the version being written into it
        # a version waiting for a credit, and the relay to write it (None: the publisher)
        self.waiting: tuple[int, Delivery, str | None] | None = None
        self.relay: str | None = None  # the relay writing ``busy``, which only it can give back
        self.relay_handle: Delivery | None = None
        self.segments: dict[int, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}


FANOUTS = ("direct", "chain", "tree")


def check_fanout(fanout: object, degree: object) -> tuple[str, int]:
    if fanout not in FANOUTS:
        raise ValueError(f"fanout must be one of {FANOUTS}, got {fanout!r}")
    if not isinstance(degree, int) or isinstance(degree, bool) or not 1 <= degree <= MAX_DEGREE:
        raise ValueError(
            f"degree (subscribers each writer serves in a tree) must be an int from 1 to "
            f"{MAX_DEGREE}, got {degree!r}"
        )
    return str(fanout), degree
