"""Senders of notifications whose identity is not yet checked (a Transport without a secret)."""

from __future__ import annotations

import threading
from collections import OrderedDict

#: frames held (in count and bytes) while their senders are checked; past either, new ones are
#: refused (counted and logged by the control channel). As much as the queue of unread
#: notifications holds (control.MAX_QUEUED_*): a first burst of a sender not checked yet is
#: never cut shorter than the same burst of a known one
MAX_HELD_FRAMES = 1 << 16
MAX_HELD_BYTES = 64 << 20
#: agents found to be who they say (the oldest is forgotten first, then checked again)
MAX_KNOWN = 4096


class Senders:
    """Which sender agents a Transport without a secret believes, and the frames of those it has
    not checked yet.

    It owns the held frames, per agent in arrival order, bounded by :data:`MAX_HELD_FRAMES` and
    :data:`MAX_HELD_BYTES`, the agents checked and found to be who they say whose frames still
    wait (``proven``), and the agents known (at most :data:`MAX_KNOWN`). Threads and order: the
    engine thread holds frames (:meth:`hold`) and delivers them (:meth:`release`); the
    housekeeping thread only checks (:meth:`waiting`, then :meth:`prove` or :meth:`forget`), so
    every frame is delivered on the engine thread, and an agent's frames in the order they
    came: while an agent has an entry, each new frame of it is held behind the others, and the
    entry ends (the agent is known) only when :meth:`release` hands over the last of them.
    One lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: OrderedDict[str, list[bytes]] = OrderedDict()
        self._proven: set[str] = set()
        self._frames = 0
        self._bytes = 0
        self._known: OrderedDict[str, None] = OrderedDict()

    def known(self, agent: str) -> bool:
        return agent in self._known

    def holding(self, agent: str) -> bool:
        return agent in self._held

    @property
    def releasable(self) -> bool:
        """Whether some proven agent's frames wait for :meth:`release` (read without the lock:
        the engine asks it every round)."""
        return bool(self._proven)

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

    def waiting(self) -> list[str]:
        """The agents whose frames wait to be checked (not yet proven)."""
        with self._lock:
            return [agent for agent in self._held if agent not in self._proven]

    def prove(self, agent: str) -> None:
        """Housekeeping found ``agent`` to be who it says: its frames go at the next release."""
        with self._lock:
            if agent in self._held:
                self._proven.add(agent)

    def release(self) -> list[tuple[str, list[bytes]]]:
        """Engine thread: the held frames of every proven agent, in order; each is known from
        now on, so its next frames go straight through, after these."""
        with self._lock:
            out = []
            for agent in self._proven:
                frames = self._held.pop(agent, [])
                self._frames -= len(frames)
                self._bytes -= sum(len(f) for f in frames)
                out.append((agent, frames))
                self._known[agent] = None
                self._known.move_to_end(agent)
                if len(self._known) > MAX_KNOWN:
                    self._known.popitem(last=False)
            self._proven.clear()
            return out

    def forget(self, agent: str) -> int:
        """Drop ``agent``'s entry (it is not who it says); the number of frames it held."""
        with self._lock:
            frames = self._held.pop(agent, [])
            self._proven.discard(agent)
            self._frames -= len(frames)
            self._bytes -= sum(len(f) for f in frames)
            return len(frames)
