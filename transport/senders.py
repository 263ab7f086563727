"""Senders of notifications whose identity is not yet checked (a Transport without a secret)."""

from __future__ import annotations

import threading
from collections import OrderedDict

#: frames held (in count and bytes) while their senders are checked; past either, new ones are
#: refused (counted and logged by the control channel)
MAX_HELD_FRAMES = 4096
MAX_HELD_BYTES = 16 << 20
#: agents found to be who they say (the oldest is forgotten first, then checked again)
MAX_KNOWN = 4096


class Senders:
    """Which sender agents a Transport without a secret believes, and the frames of those it has
    not checked yet.

    It owns the held frames, per agent in arrival order, bounded by :data:`MAX_HELD_FRAMES` and
    :data:`MAX_HELD_BYTES`, and the agents found to be who they say (at most :data:`MAX_KNOWN`).
    Rules: while an agent has an entry, every new frame of it is held behind the others (so a
    sender's frames are delivered in order even across the check); :meth:`trust` ends an entry
    only when no frame is left in it. One lock; the engine thread holds and the housekeeping
    thread checks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: OrderedDict[str, list[bytes]] = OrderedDict()
        self._frames = 0
        self._bytes = 0
        self._known: OrderedDict[str, None] = OrderedDict()

    def known(self, agent: str) -> bool:
        return agent in self._known

    def holding(self, agent: str) -> bool:
        return agent in self._held

    def hold(self, agent: str, frames: list[bytes]) -> int:
        """Hold ``frames`` of ``agent`` until it is checked; the number refused for space."""
        with self._lock:
            held = self._held.setdefault(agent, [])
            for i, frame in enumerate(frames):
                if self._frames >= MAX_HELD_FRAMES or self._bytes + len(frame) > MAX_HELD_BYTES:
                    return len(frames) - i
                held.append(frame)
                self._frames += 1
                self._bytes += len(frame)
            return 0

    def waiting(self) -> list[tuple[str, list[bytes]]]:
        """Take the held frames of every agent waiting to be checked (its entry stays)."""
        with self._lock:
            return [(agent, self._take(agent)) for agent in self._held]

    def trust(self, agent: str) -> list[bytes]:
        """The frames ``agent`` sent since they were taken; when none, it is known from now on."""
        with self._lock:
            frames = self._take(agent)
            if not frames:
                self._held.pop(agent, None)
                self._known[agent] = None
                if len(self._known) > MAX_KNOWN:
                    self._known.popitem(last=False)
            return frames

    def forget(self, agent: str) -> int:
        """Drop ``agent``'s entry; the number of frames it still held."""
        with self._lock:
            frames = self._take(agent)
            self._held.pop(agent, None)
            return len(frames)

    def _take(self, agent: str) -> list[bytes]:
        frames = self._held.get(agent) or []
        if frames:
            self._held[agent] = []
            self._frames -= len(frames)
            self._bytes -= sum(len(f) for f in frames)
        return frames
