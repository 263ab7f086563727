"""What every part of one Transport shares: who it is, its agent and engine, its settings."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transport.errors import ClosedError
from transport.security.sealing import Keys, keys_for
from transport.wire import agent_name

if TYPE_CHECKING:
    from transport.backends.base import Backend
    from transport.memory.local import LocalMemory
    from transport.peers.directory import Directory
    from transport.progress_engine import ProgressEngine
    from transport.settings import Settings
    from transport.store import Store
    from transport.trace import FlightRecorder


class State(enum.Enum):
    """Whether a Transport is open: OPEN from construction, CLOSED from the moment ``close()``
    begins, and never open again."""

    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False)
class SharedState:
    """The identity and shared services of one Transport, handed to each of its parts
    (regions, peer table, plan cache, transfers, control channel, housekeeping, dumps).

    It owns no behaviour beyond the open state: ``state`` changes once, in ``Transport.close``
    (under ``lock``); everything else reads it without a lock, so a call that checked it just
    before close began may go on, and close fails what the engines still hold with ClosedError.
    ``wake`` asks the housekeeping thread to run now (retries, dumps, withdrawals); ``stopping``
    is set when the Transport closes, for every wait that must end then. ``lock`` is the
    Transport's own (lifecycle only); each part guards its state with a lock of its own.
    """

    name: str
    namespace: str
    generation: int
    secret: bytes | None
    backend: Backend
    backend_kind: str
    mem: LocalMemory
    directory: Directory
    store: Store
    recorder: FlightRecorder
    settings: Settings
    created: float
    engine: ProgressEngine = field(init=False)
    state: State = State.OPEN
    lock: threading.RLock = field(default_factory=threading.RLock)
    wake: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def agent(self) -> str:
        """Our backend agent's name (what peers see as the sender of our notifications)."""
        return agent_name(self.name, self.generation)

    @property
    def keys(self) -> Keys | None:
        """The keys of the namespace's secret (None without one)."""
        return keys_for(self.secret, self.namespace) if self.secret else None

    @property
    def open(self) -> bool:
        return self.state is State.OPEN

    def check_open(self) -> None:
        """ClosedError if the Transport is closed, or unusable because its engine died."""
        if self.state is not State.OPEN:
            raise ClosedError(f"transport {self.name!r} is closed; open a new Transport")
        if self.engine.error is not None:
            raise ClosedError(
                f"transport {self.name!r} is unusable: its engine thread died ({self.engine.error!r})"
            )
