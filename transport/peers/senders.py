"""Senders of notifications whose identity is not yet checked (a Transport without a secret)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

#: frames held (in count and bytes) while their senders are checked; past either, new ones are
#: refused (counted and logged by the control channel). As much as the queue of unread
#: notifications holds (control.MAX_QUEUED_*): a first burst of a sender not checked yet is
#: never cut shorter than the same burst of a known one
MAX_HELD_FRAMES = 1 << 16
MAX_HELD_BYTES = 64 << 20
#: agents found to be who they say (the oldest is forgotten first, then checked again)
MAX_KNOWN = 4096
#: how long the frames of an agent the store does not show yet are held, checked again once a
#: heartbeat interval: a store that restarted empty has every live record back within one
HOLD_S = 5.0
#: how long an agent the store shows to be someone else (its peer's record names another agent)
#: is refused on receipt, without a store read; at most MAX_KNOWN of them are remembered
REFUSE_S = 10.0
#: store reads one round of checks makes at most (the agents that waited longest first)
CHECKS_PER_ROUND = 256


class Released(NamedTuple):
    """The held frames of one proven agent, in arrival order, and when the last of them came
    (``arrived``, on the clock :meth:`Senders.hold` was given)."""

    agent: str
    frames: list[bytes]
    arrived: float


class Senders:
    """Which sender agents a Transport without a secret believes, and the frames of those it has
    not checked yet.

    It owns the held frames, per agent in arrival order, bounded by :data:`MAX_HELD_FRAMES` and
    :data:`MAX_HELD_BYTES`, when each agent's frames were first held and last checked, the
    agents checked and found to be who they say whose frames still wait (``proven``), the agents
    known (at most :data:`MAX_KNOWN`) and those refused lately (likewise, for :data:`REFUSE_S`).
    Threads and order: the engine thread holds frames (:meth:`hold`) and delivers them
    (:meth:`release`); the housekeeping thread only checks (:meth:`due`, then :meth:`prove`,
    :meth:`forget` or nothing: checked again later), so every frame is delivered on the engine
    thread, and an agent's frames in the order they came: while an agent has an entry, each new
    frame of it is held behind the others, and the entry ends (the agent is known) only when
    :meth:`release` hands over the last of them. What a flood of agents costs is bounded: the
    frames held, one store read per agent when it comes and at most one per heartbeat interval
    after (for :data:`HOLD_S`), at most :data:`CHECKS_PER_ROUND` reads a round. One lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: OrderedDict[str, list[bytes]] = OrderedDict()
        self._since: dict[str, float] = {}  # agent -> when its first held frame came
        self._latest: dict[str, float] = {}  # agent -> when its last held frame came
        self._checked: dict[str, float] = {}  # agent -> when the store was last asked
        self._proven: set[str] = set()
        self._frames = 0
        self._bytes = 0
        self._known: OrderedDict[str, None] = OrderedDict()
        self._refused: OrderedDict[str, float] = OrderedDict()  # agent -> refused until

    def known(self, agent: str) -> bool:
        return agent in self._known

    def holding(self, agent: str) -> bool:
        return agent in self._held

    def refused(self, agent: str, now: float) -> bool:
        """Whether ``agent`` was found to be someone else within the last :data:`REFUSE_S`."""
        until = self._refused.get(agent)
        return until is not None and now < until

    @property
    def releasable(self) -> bool:
        """Whether some proven agent's frames wait for :meth:`release` (read without the lock:
        the engine asks it every round)."""
        return bool(self._proven)

    def hold(self, agent: str, frames: list[bytes], now: float) -> int:
        """Hold ``frames`` of ``agent`` until it is checked; the number refused for space."""
        with self._lock:
            held = self._held.setdefault(agent, [])
            self._since.setdefault(agent, now)
            self._latest[agent] = now
            for i, frame in enumerate(frames):
                if self._frames >= MAX_HELD_FRAMES or self._bytes + len(frame) > MAX_HELD_BYTES:
                    return len(frames) - i
                held.append(frame)
                self._frames += 1
                self._bytes += len(frame)
            return 0

    def due(self, now: float, interval: float) -> list[str]:
        """The agents to check now: not proven, never checked or not within ``interval``
        seconds; those that waited longest first, at most :data:`CHECKS_PER_ROUND`. Each is
        marked checked."""
        with self._lock:
            out = []
            for agent in self._held:
                if agent in self._proven or now - self._checked.get(agent, -1e18) < interval:
                    continue
                self._checked[agent] = now
                out.append(agent)
                if len(out) >= CHECKS_PER_ROUND:
                    break
            return out

    def expired(self, agent: str, now: float) -> bool:
        """Whether ``agent``'s frames have waited :data:`HOLD_S` for the store to show it."""
        return now - self._since.get(agent, now) >= HOLD_S

    def prove(self, agent: str) -> None:
        """Housekeeping found ``agent`` to be who it says: its frames go at the next release."""
        with self._lock:
            if agent in self._held:
                self._proven.add(agent)

    def release(self) -> list[Released]:
        """Engine thread: the held frames of every proven agent, in order; each is known from
        now on, so its next frames go straight through, after these."""
        with self._lock:
            out = []
            for agent in self._proven:
                arrived = self._latest.get(agent, 0.0)
                out.append(Released(agent, self._drop(agent), arrived))
                self._known[agent] = None
                self._known.move_to_end(agent)
                if len(self._known) > MAX_KNOWN:
                    self._known.popitem(last=False)
            self._proven.clear()
            return out

    def forget(self, agent: str, refuse_until: float | None = None) -> int:
        """Drop ``agent``'s entry (it is not who it says); the number of frames it held. With
        ``refuse_until``, its frames are refused on receipt until then."""
        with self._lock:
            self._proven.discard(agent)
            if refuse_until is not None:
                self._refused[agent] = refuse_until
                self._refused.move_to_end(agent)
                if len(self._refused) > MAX_KNOWN:
                    self._refused.popitem(last=False)
            return len(self._drop(agent))

    def _drop(self, agent: str) -> list[bytes]:
        frames = self._held.pop(agent, [])
        self._since.pop(agent, None)
        self._latest.pop(agent, None)
        self._checked.pop(agent, None)
        self._frames -= len(frames)
        self._bytes -= sum(len(f) for f in frames)
        return frames
