"""Regions: the memory one Transport exposes and registers, its peer record, and withdrawal.

Withdrawing a region (``Transport.unexpose``) without a writer writing into it after: the owner
takes the region out of its record, then tells every peer of the namespace (a
:class:`Withdraw` message on the control channel ``tx/withdraw``). A peer stops using the region
at once (its plans on it stop, so new puts fail with RegionError), waits until the transfers it
had posted into it have ended, and answers ``dropped``. Once every peer has answered, or at the
timeout, the owner deregisters the memory (unless another exposed region shares it) and
``unexpose`` returns the peers that did not answer: only they may still write there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import torch

from transport._version import __version__
from transport.endpoint import Endpoint
from transport.errors import TransportError, WireFormatError
from transport.memory import check_tensor, dtype_name
from transport.wire import (
    ACCESS_MODES,
    PeerRecord,
    RegionInfo,
    agent_name,
    check_region_name,
    unpack,
)

if TYPE_CHECKING:
    from transport.control import ControlChannel
    from transport.peer_table import PeerTable
    from transport.plan_cache import PlanCache

log = logging.getLogger("transport")

CHANNEL = "tx/withdraw"


@dataclass(frozen=True)
class Withdraw:
    """A message of a withdrawal: ``kind`` "withdraw" (the owner's) or "dropped" (a writer's
    answer), the region, and the owner's generation. On the wire: a msgpack map k/r/g."""

    kind: str
    region: str
    generation: int

    def encode(self) -> bytes:
        out: bytes = msgpack.packb(
            {"k": self.kind, "r": self.region, "g": self.generation}, use_bin_type=True
        )
        return out

    @classmethod
    def decode(cls, payload: bytes) -> Withdraw:
        m = unpack(payload, "withdraw message", 8192, max_str=4096, max_array=0, max_map=4)
        if (
            not isinstance(m, dict)
            or set(m) != {"k", "r", "g"}
            or m["k"] not in ("withdraw", "dropped")
            or not isinstance(m["r"], str)
            or not m["r"]
            or not isinstance(m["g"], int)
            or isinstance(m["g"], bool)
        ):
            raise WireFormatError(f"malformed withdraw message {str(m)[:80]}")
        return cls(m["k"], m["r"], m["g"])


@dataclass(frozen=True)
class _Pending:
    """A peer's withdrawal we are to answer once nothing of ours is in flight into it."""

    owner: str
    region: str
    generation: int
    deadline: float


class Regions:
    """One Transport's own memory: the regions it exposes, the names of registered tensors, and
    the peer record that lists them; and both sides of withdrawal.

    It owns the region table, the local names (``(address, bytes)`` -> region name, read without
    a lock by the fast paths), the published record, the answers awaited per region being
    withdrawn and the peers' withdrawals still to answer. ``lock`` guards the tables and the
    record (held while it is published: the store sees records in order); ``_cond`` guards the
    withdrawal state. Threads: expose, register and :meth:`withdraw` run on callers' threads
    (withdraw blocks up to its timeout, and deregisters the memory at the end whoever answered);
    :meth:`_on_message` runs on the engine thread and only records; :meth:`run` runs on the
    housekeeping thread, which stops plans and answers. Answers that come late, or name another
    generation of ours, are ignored. A writer answers once nothing of its own is in flight into
    the region, or at its own timeout.
    """

    def __init__(
        self, ep: Endpoint, control: ControlChannel, peers: PeerTable, plans: PlanCache
    ) -> None:
        self._ep = ep
        self._control = control
        self._peers = peers
        self._plans = plans
        self.lock = threading.RLock()
        self._regions: dict[str, tuple[torch.Tensor, RegionInfo]] = {}
        # the registered memory (address, bytes, device) under each exposed region
        self._under: dict[str, tuple[int, int, str]] = {}
        self.local_names: dict[tuple[int, int], str] = {}
        self.record: PeerRecord | None = None
        self._cond = threading.Condition()
        self._acks: dict[str, set[str]] = {}  # region being withdrawn -> peers that answered
        self._pending: list[_Pending] = []
        self._stop_listening = control.on_control(CHANNEL, self._on_message)

    # -- exposing and registering ------------------------------------------------------------

    def expose_all(self, tensors: Mapping[str, torch.Tensor], access: str) -> dict[str, RegionInfo]:
        ep = self._ep
        ep.check_open()
        if access not in ACCESS_MODES:
            raise ValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"expose_all takes a mapping of name -> tensor, got {type(tensors).__name__}"
            )
        checked = []
        for name, t in tensors.items():
            check_region_name(name)
            check_tensor(t, f"region {name!r}")
            if t.numel() == 0:
                raise ValueError(
                    f"region {name!r} is empty; expose a tensor with at least one element"
                )
            if name in self._regions:
                raise ValueError(
                    f"region {name!r} is already exposed by {ep.name!r}; expose it under another name"
                )
            checked.append((name, t))
        out = {}
        with self.lock:
            regs = ep.mem.ensure_all(checked)
            for (name, t), reg in zip(checked, regs, strict=True):
                info = RegionInfo(name, t.data_ptr(), t.nbytes, dtype_name(t.dtype),
                                  tuple(t.shape), access, reg.device)  # fmt: skip
                self._regions[name] = (t, info)
                self._under[name] = (reg.base, reg.nbytes, reg.device)
                self.local_names[(t.data_ptr(), t.nbytes)] = name
                out[name] = info
            self.publish()
        return out

    def register(self, tensor: torch.Tensor, name: str | None) -> None:
        self._ep.check_open()
        check_tensor(tensor)
        if name is not None:
            check_region_name(name)
        with self.lock:
            self._ep.mem.ensure(tensor, explicit=True)
            if name is not None:
                self.local_names[(tensor.data_ptr(), tensor.nbytes)] = name

    def infos(self) -> dict[str, RegionInfo]:
        return {n: info for n, (_, info) in self._regions.items()}

    def publish(self) -> None:
        """Write this Transport's record (its agent, metadata and regions) to the store."""
        ep = self._ep
        with self.lock:
            regs = self._exposed_registrations()
            rec = PeerRecord(
                name=ep.name, namespace=ep.namespace, generation=ep.generation,
                agent=agent_name(ep.name, ep.generation), backend=ep.backend.name,
                metadata=ep.backend.metadata(regs), host=socket.gethostname()[:255] or "?",
                pid=os.getpid(), version=__version__, created=ep.created,
                regions=tuple(info for _, info in self._regions.values()),
                registrations=regs, revision=self.record.revision + 1 if self.record else 1,
            )  # fmt: skip
            ep.directory.publish(rec)
            self.record = rec

    def restore(self) -> bool:
        """Housekeeping: publish the record again if the store lost it or holds one we did not
        write (True then). Under the lock: an expose meanwhile must not be undone."""
        with self.lock:
            return self.record is not None and self._ep.directory.restore(self.record)

    def _exposed_registrations(self) -> tuple[tuple[int, int, str], ...]:
        """The registered memory under the exposed regions: each tensor's whole storage, or the
        allocation holding it (what the registration cache registered)."""
        seen: dict[tuple[int, str], int] = {}
        for addr, n, dev in set(self._under.values()):
            seen[(addr, dev)] = max(seen.get((addr, dev), 0), n)
        return tuple((addr, n, dev) for (addr, dev), n in sorted(seen.items()))

    # -- withdrawing our own -----------------------------------------------------------------

    def withdraw(self, name: str, timeout: float) -> list[str]:
        ep = self._ep
        with self.lock:
            ep.check_open()
            entry = self._regions.get(name)
            if entry is None:
                raise KeyError(
                    f"region {name!r} is not exposed by {ep.name!r} (exposed: {sorted(self._regions)[:10]})"
                )
            tensor, info = entry
            del self._regions[name]
            del self._under[name]
            self.local_names.pop((info.addr, info.nbytes), None)
            with self._cond:
                self._acks[name] = set()
            self.publish()  # new readers of the record no longer see it
        asked = []
        message = Withdraw("withdraw", name, ep.generation).encode()
        for peer in [n for n in ep.directory.names() if n != ep.name]:
            try:
                self._control.send_control(peer, CHANNEL, message)
            except TransportError:
                continue  # not there (left, or never connected to a live incarnation)
            asked.append(peer)
        ep.recorder.record("withdraw", peers=tuple(asked), nbytes=info.nbytes, keys=name)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not set(asked) <= self._acks[name]:
                left = deadline - time.monotonic()
                if left <= 0 or not ep.open:
                    break
                self._cond.wait(min(left, 0.05))
            silent = sorted(set(asked) - self._acks.pop(name))
        if silent:
            log.warning(
                "region %s withdrawn; %s did not confirm within %.3g s and may still write it",
                name, ", ".join(silent), timeout,
            )  # fmt: skip
        with self.lock:
            ep.mem.release_explicit(tensor, still_used=[x for x, _ in self._regions.values()])
        return silent

    # -- answering the peers' withdrawals ----------------------------------------------------

    def _on_message(self, peer: str, payload: bytes) -> None:
        """Engine thread: bookkeeping only; the housekeeping thread does the rest."""
        try:
            m = Withdraw.decode(payload)
        except WireFormatError as e:
            log.warning("dropping a withdraw message from %s: %s", peer, e)
            return
        if m.kind == "dropped":
            with self._cond:
                acks = self._acks.get(m.region)
                if acks is not None and m.generation == self._ep.generation:
                    acks.add(peer)
                    self._cond.notify_all()
            return
        deadline = time.monotonic() + self._ep.settings.timeout
        with self._cond:
            self._pending.append(_Pending(peer, m.region, m.generation, deadline))
        self._ep.wake.set()

    def run(self) -> None:
        """Housekeeping: drop what was withdrawn; answer once nothing is in flight into it."""
        with self._cond:
            if not self._pending:
                return
            jobs, self._pending = self._pending, []
        later = []
        for job in jobs:
            if self._stop_using(job) or time.monotonic() > job.deadline:
                answer = Withdraw("dropped", job.region, job.generation).encode()
                try:
                    self._control.send_control(job.owner, CHANNEL, answer)
                except TransportError as e:
                    log.info(
                        "could not confirm the withdrawal of %s to %s: %s", job.region, job.owner, e
                    )
            else:
                later.append(job)
        if later:
            with self._cond:
                self._pending.extend(later)
            self._ep.wake.set()  # look again soon

    def _stop_using(self, job: _Pending) -> bool:
        """Stop every plan on the withdrawn region; True once none is in flight."""
        conn = self._peers.get(job.owner)
        if conn is None or conn.generation != job.generation:
            return True  # never wrote to that incarnation
        return self._plans.stop_region(conn, job.region)

    def close(self) -> None:
        self._stop_listening()
        with self._cond:
            self._cond.notify_all()
