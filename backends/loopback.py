"""An in-process loopback backend, for fast unit tests of the layers above the backend.

Every agent is an object in this process, found by name in a process-wide table; a transfer is a
``memmove`` between registered host memory, done when it is posted; a notification lands in the
target agent's queue. Two Transports made with ``backend="loopback"`` in one process therefore
exercise the engine, plans, fan-out, notifications and failure paths in milliseconds, without
NIXL. It is never the default, and integration tests never use it: they run real NIXL agents in
real processes.

Faults, for tests: :func:`freeze` holds every transfer and notification to an agent until
:func:`thaw` (a frozen peer, as SIGSTOP makes one); a closed agent fails them with
:class:`PeerLostError` (a killed peer).

Where it is stricter than NIXL, on purpose: it copies host memory only, and it refuses to write
or read memory that is not registered at the time of the copy (NIXL would write into memory a
peer has deregistered; in one process that would corrupt the test itself).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transport.backends.base import DONE, IN_PROGRESS, READ, WRITE, Backend, device_parts
from transport.errors import BackendError, ClosedError, PeerLostError, RegionError

_lock = threading.RLock()  # guards every agent's state: tests need correctness, not speed
_agents: dict[str, LoopbackBackend] = {}
_frozen: set[str] = set()
_incarnations = itertools.count(1)
_PREFIX = b"loopback/"


def freeze(agent: str) -> None:
    """Hold transfers and notifications to ``agent`` in progress (as if it were stopped)."""
    with _lock:
        _frozen.add(agent)


def thaw(agent: str) -> None:
    """Let transfers to ``agent`` complete again (held ones complete at their next poll)."""
    with _lock:
        _frozen.discard(agent)


@dataclass
class _Prepped:
    """Prepared descriptor rows: of our own memory (``agent`` None) or of a peer agent's."""

    agent: str | None  # None: local
    rows: np.ndarray


@dataclass
class _Xfer:
    """One transfer made by ``make_xfer``: the rows at both ends, the target agent, the
    notification it carries, and whether a post is waiting for a frozen target to thaw."""

    op: str
    local: np.ndarray
    remote: np.ndarray
    target: str
    notif: bytes
    pending: bool = False


class LoopbackBackend(Backend):
    """One in-process agent: its registrations, the peers it loaded, its incoming notifications.

    Rules: every call may come from any thread (one process-wide lock); a transfer copies when it
    is posted, or at a poll once its target is thawed; a transfer to a closed agent fails with
    PeerLostError; closing is idempotent and makes the name free for a new incarnation.
    """

    name = "loopback"

    def __init__(self, agent_name: str, num_threads: int = 0) -> None:
        with _lock:
            if agent_name in _agents:
                raise BackendError(f"a loopback agent named {agent_name!r} already exists")
            _agents[agent_name] = self
        self.agent_name = agent_name
        self.incarnation = next(_incarnations)
        self.regions: dict[int, tuple[int, int]] = {}  # token -> (address, length)
        self._tokens = itertools.count(1)
        self._peers: dict[str, int] = {}  # agent name -> incarnation loaded
        self.notifs: dict[str, list[bytes]] = {}
        self.held: dict[str, list[bytes]] = {}  # bare notifications sent while it was frozen
        self._closed = False

    # -- setup ---------------------------------------------------------------------------------

    def metadata(self, memory: Sequence[tuple[int, int, str]] = ()) -> bytes:
        return _PREFIX + f"{self.agent_name}\n{self.incarnation}".encode()

    def register(self, addr: int, nbytes: int, device: str) -> Any:
        kind, _ = device_parts(device)
        if kind != "DRAM":
            raise BackendError("the loopback backend copies host memory only; use NIXL for GPUs")
        with _lock:
            self._check_open()
            token = next(self._tokens)
            self.regions[token] = (addr, nbytes)
        return token

    def deregister(self, token: Any) -> None:
        with _lock:
            self.regions.pop(token, None)

    def add_peer(self, metadata: bytes) -> str:
        if not metadata.startswith(_PREFIX) or metadata.count(b"\n") != 1:
            raise BackendError("not the metadata of a loopback agent")
        name, _, inc = metadata[len(_PREFIX) :].decode().partition("\n")
        with _lock:
            self._check_open()
            peer = _agents.get(name)
            if peer is None or str(peer.incarnation) != inc:
                raise PeerLostError(f"loopback agent {name!r} (incarnation {inc}) is gone", name)
            self._peers[name] = peer.incarnation
        return name

    def remove_peer(self, agent: str) -> None:
        with _lock:
            self._peers.pop(agent, None)

    def prep(self, agent: str | None, descs: np.ndarray, device: str) -> Any:
        rows = np.array(descs, dtype=np.uint64).reshape(-1, 3)
        with _lock:
            if agent is None:
                self._check_open()
                if not _inside(self.regions.values(), rows):
                    raise RegionError(
                        "local descriptors outside the loopback agent's registrations"
                    )
            else:
                self._target(agent, agent)
        return _Prepped(agent, rows)

    def release_prepped(self, prepped: Any) -> None:
        pass

    # -- transfers -----------------------------------------------------------------------------

    def make_xfer(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        notif: bytes,
        peer: str,
    ) -> Any:
        if op not in (READ, WRITE):
            raise ValueError(f"op must be READ or WRITE, got {op!r}")
        lo, re = local.rows[np.asarray(local_idx)], remote.rows[np.asarray(remote_idx)]
        if len(lo) != len(re) or not np.array_equal(lo[:, 1], re[:, 1]):
            raise RegionError("local and remote descriptors do not pair up")
        return _Xfer(op, lo, re, remote.agent, notif)

    def post(self, xfer: Any, notif: bytes, peer: str) -> int:
        with _lock:
            self._check_open()
            self._target(xfer.target, peer)
            xfer.notif = notif or xfer.notif
            if xfer.target in _frozen:
                xfer.pending = True
                return IN_PROGRESS
            self._copy(xfer, peer)
        return DONE

    def poll(self, xfer: Any, peer: str) -> int:
        with _lock:
            if not xfer.pending:
                return DONE
            self._target(xfer.target, peer)
            if xfer.target in _frozen:
                return IN_PROGRESS
            self._copy(xfer, peer)
        return DONE

    def release_xfer(self, xfer: Any) -> bool:
        with _lock:
            xfer.pending = False  # an aborted transfer copies nothing
        return True

    def get_notifs(self) -> dict[str, list[bytes]]:
        with _lock:
            if self.held and self.agent_name not in _frozen:  # sent while it was frozen
                for sender, msgs in self.held.items():
                    self.notifs.setdefault(sender, [])[:0] = msgs
                self.held = {}
            out, self.notifs = self.notifs, {}
        return out

    def send_notif(self, agent: str, message: bytes, peer: str) -> None:
        with _lock:
            self._check_open()
            target = self._target(agent, peer)
            queue = target.held if agent in _frozen else target.notifs
            queue.setdefault(self.agent_name, []).append(bytes(message))

    def close(self) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            if _agents.get(self.agent_name) is self:
                del _agents[self.agent_name]
            self.regions.clear()

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"loopback agent {self.agent_name!r} is closed")

    def _target(self, agent: str, peer: str) -> LoopbackBackend:
        target = _agents.get(agent)
        if target is None or self._peers.get(agent) != target.incarnation:
            raise PeerLostError(f"loopback agent {agent!r} went away", peer)
        return target

    def _copy(self, xfer: _Xfer, peer: str) -> None:
        target = self._target(xfer.target, peer)
        if not _inside(target.regions.values(), xfer.remote):
            raise PeerLostError(f"memory of loopback agent {xfer.target!r} is not registered", peer)
        if not _inside(self.regions.values(), xfer.local):
            raise RegionError("local memory of a transfer is not registered any more")
        for (la, n, _), (ra, _, _) in zip(xfer.local.tolist(), xfer.remote.tolist(), strict=True):
            src, dst = (la, ra) if xfer.op == WRITE else (ra, la)
            ctypes.memmove(dst, src, n)
        xfer.pending = False
        if xfer.notif:
            target.notifs.setdefault(self.agent_name, []).append(xfer.notif)


def _inside(regions: Any, rows: np.ndarray) -> bool:
    """Whether every row lies inside one registration: the spans sorted once, each row found by
    bisection (a model of 100,000 tensors is 100,000 of each); nested or overlapping
    registrations are searched back only while one ending past the row may still hold it."""
    spans = sorted(regions)
    starts = [a for a, _ in spans]
    reach = list(itertools.accumulate((a + size for a, size in spans), max))
    for addr, n, _ in rows.tolist():
        i = bisect.bisect_right(starts, addr) - 1
        while i >= 0 and reach[i] >= addr + n:
            if spans[i][0] + spans[i][1] >= addr + n:
                break
            i -= 1
        else:
            return False
    return True
