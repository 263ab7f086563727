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

import itertools
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
from transport.errors import StoreError, TransportError, WireFormatError
from transport.gc_pause import without_gc
from transport.memory.local import check_tensor, dtype_name
from transport.shared_state import SharedState
from transport.wire import (
    ACCESS_MODES,
    MAX_NOTIFY_BYTES,
    MAX_REGION_NAME,
    PeerRecord,
    RegionInfo,
    agent_name,
    check_region_name,
    is_count,
    unpack,
)

if TYPE_CHECKING:
    from transport.control import ControlChannel
    from transport.peers.table import PeerTable
    from transport.transfers.plan_cache import PlanCache

log = logging.getLogger(__name__)

CHANNEL = "tx/withdraw"
#: how often a withdrawal that waits for silent peers looks whether they left
LEFT_LOOK_S = 0.25
#: the most bytes of region names in one withdraw message (a notification holds 64 KiB)
WITHDRAW_BATCH_BYTES = 48 << 10


@dataclass(frozen=True)
class Withdraw:
    """A message of a withdrawal: ``kind`` "withdraw" (the owner's) or "dropped" (a writer's
    answer), the regions (as many as fit in one notification: a withdrawal of many regions
    travels in several), the owner's generation and, in a "withdraw", the revision of the
    owner's record without them (0: not said): a writer then takes no older record of that
    incarnation, whoever hands it one. On the wire: a msgpack map k/r/g[/v]."""

    kind: str
    regions: tuple[str, ...]
    generation: int
    revision: int = 0

    def encode(self) -> bytes:
        body: dict[str, object] = {"k": self.kind, "r": list(self.regions), "g": self.generation}
        if self.revision:
            body["v"] = self.revision
        out: bytes = msgpack.packb(body, use_bin_type=True)
        return out

    @classmethod
    def decode(cls, payload: bytes) -> Withdraw:
        m = unpack(
            payload,
            "withdraw message",
            MAX_NOTIFY_BYTES,
            max_str=MAX_REGION_NAME * 4,
            max_array=MAX_NOTIFY_BYTES // 2,
            max_map=4,
        )
        if (
            not isinstance(m, dict)
            or not {"k", "r", "g"} <= set(m) <= {"k", "r", "g", "v"}
            or m["k"] not in ("withdraw", "dropped")
            or not isinstance(m["r"], list)
            or not m["r"]
            or not all(isinstance(r, str) and 0 < len(r) <= MAX_REGION_NAME for r in m["r"])
            or not is_count(m["g"])
            or not is_count(m.get("v", 0))
        ):
            raise WireFormatError(f"malformed withdraw message {str(m)[:80]}")
        return cls(m["k"], tuple(m["r"]), m["g"], m.get("v", 0))


def batches(names: list[str], limit: int = WITHDRAW_BATCH_BYTES) -> list[tuple[str, ...]]:
    """``names`` cut into runs whose message fits in one notification."""
    out: list[tuple[str, ...]] = []
    run: list[str] = []
    size = 0
    for name in names:
        n = len(name.encode()) + 5  # msgpack's string header at most
        if run and size + n > limit:
            out.append(tuple(run))
            run, size = [], 0
        run.append(name)
        size += n
    if run:
        out.append(tuple(run))
    return out


class _Withdrawal:
    """One ``withdraw`` call's regions and the peers' answers: ``answered`` until the peers
    asked are known, then ``waiting`` (region -> peers yet to answer; empty: all answered)."""

    def __init__(self, regions: list[str]) -> None:
        self.answered: dict[str, set[str]] = {r: set() for r in regions}
        self.waiting: dict[str, set[str]] | None = None

    def ack(self, region: str, peer: str) -> None:
        if self.waiting is None:
            self.answered[region].add(peer)
            return
        left = self.waiting.get(region)
        if left is not None:
            left.discard(peer)
            if not left:
                del self.waiting[region]

    def asked(self, peers: list[str]) -> None:
        want = set(peers)
        self.waiting = {r: want - a for r, a in self.answered.items() if want - a}

    def silent(self) -> list[str]:
        return sorted(set().union(*self.waiting.values())) if self.waiting else []

    def gone(self, peer: str) -> None:
        """``peer`` left while we waited: nothing of it can write there any more."""
        for region in list(self.waiting or ()):
            self.ack(region, peer)


@dataclass(frozen=True)
class _Pending:
    """A peer's withdrawal we are to answer once nothing of ours is in flight into it."""

    owner: str
    regions: tuple[str, ...]
    generation: int
    deadline: float
    revision: int = 0  # the owner's record without them (Withdraw.revision)


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
        self, ep: SharedState, control: ControlChannel, peers: PeerTable, plans: PlanCache
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
        self._withdrawals: dict[str, _Withdrawal] = {}  # region being withdrawn -> its call
        self._pending: list[_Pending] = []
        self._stop_listening = control.on_control(CHANNEL, self._on_message)

    # -- exposing and registering ------------------------------------------------------------

    @without_gc
    def expose_all(self, tensors: Mapping[str, torch.Tensor], access: str) -> dict[str, RegionInfo]:
        ep = self._ep
        ep.check_open()
        if access not in ACCESS_MODES:
            raise ValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"expose_all takes a mapping of name -> tensor, got {type(tensors).__name__}"
            )
        checked = list(tensors.items())
        for name, t in checked:
            check_region_name(name)
            check_tensor(t, f"region {name!r}")
            if not t.numel():
                raise ValueError(
                    f"region {name!r} is empty; expose a tensor with at least one element"
                )
            if name in self._regions:
                raise ValueError(
                    f"region {name!r} is already exposed by {ep.name!r}; expose it under another name"
                )
        # the regions' descriptors by column (a subscriber of 100,000 tensors exposes 200,000)
        names = [name for name, _ in checked]
        views = [t for _, t in checked]
        with self.lock:
            regs = ep.mem.ensure_all(checked)
            spans = {id(reg): (reg.base, reg.nbytes, reg.device) for reg in set(regs)}
            addrs = [t.data_ptr() for t in views]
            sizes = [t.nbytes for t in views]
            infos = list(
                map(
                    RegionInfo,
                    names,
                    addrs,
                    sizes,
                    [dtype_name(t.dtype) for t in views],
                    [tuple(t.shape) for t in views],
                    itertools.repeat(access),
                    [reg.device for reg in regs],
                )
            )
            keys = list(zip(addrs, sizes, strict=True))
            named = {k: self.local_names[k] for k in keys if k in self.local_names}
            self._regions.update(zip(names, zip(views, infos, strict=True), strict=True))
            self._under.update(zip(names, [spans[id(reg)] for reg in regs], strict=True))
            self.local_names.update(zip(keys, names, strict=True))
            try:
                self.publish()
            except BaseException:
                # all or nothing: regions no record shows are not exposed (the same names may
                # be exposed again once the store answers)
                for name in names:
                    del self._regions[name], self._under[name]
                for k in keys:
                    self.local_names.pop(k, None)
                self.local_names.update(named)
                raise
        return dict(zip(names, infos, strict=True))

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
                name=ep.name,
                namespace=ep.namespace,
                generation=ep.generation,
                agent=agent_name(ep.name, ep.generation),
                backend=ep.backend.name,
                metadata=ep.backend.metadata(regs),
                host=socket.gethostname()[:255] or "?",
                pid=os.getpid(),
                version=__version__,
                created=ep.created,
                regions=tuple(info for _, info in self._regions.values()),
                registrations=regs,
                revision=self.record.revision + 1 if self.record else 1,
                hosts_store=bool(getattr(ep.store, "is_host", False)),
                bell=ep.engine.doorbell.bell,
            )
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

    def withdraw(self, names: list[str], timeout: float) -> list[str]:
        """Withdraw the regions ``names`` together (one record written, their names to each peer
        in as few messages as fit); the peers that did not confirm all of them in time."""
        ep = self._ep
        if not names:
            return []
        if len(set(names)) != len(names):
            raise ValueError("a region appears twice in the list to withdraw")
        with self.lock:
            ep.check_open()
            missing = [n for n in names if n not in self._regions]
            if missing:
                raise KeyError(
                    f"region {missing[0]!r} is not exposed by {ep.name!r} (exposed: "
                    f"{sorted(self._regions)[:10]}); nothing was withdrawn"
                )
            tensors, nbytes = [], 0
            for name in names:
                tensor, info = self._regions.pop(name)
                del self._under[name]
                self.local_names.pop((info.addr, info.nbytes), None)
                tensors.append(tensor)
                nbytes += info.nbytes
            call = _Withdrawal(names)
            with self._cond:
                for name in names:
                    self._withdrawals[name] = call
            self.publish()  # new readers of the record no longer see them
        asked = []
        revision = self.record.revision if self.record else 0
        messages = [
            Withdraw("withdraw", b, ep.generation, revision).encode() for b in batches(names)
        ]
        for peer in [n for n in ep.directory.names() if n != ep.name]:
            if self._left(peer):
                continue
            try:
                for message in messages:
                    self._control.send_control(peer, CHANNEL, message)
            except TransportError:
                continue  # not there (left, or never connected to a live incarnation)
            asked.append(peer)
        ep.recorder.record(
            "withdraw",
            peers=tuple(asked),
            nbytes=nbytes,
            keys=names[0] if len(names) == 1 else f"{len(names)} regions",
        )
        deadline = time.monotonic() + timeout
        look = time.monotonic() + LEFT_LOOK_S
        with self._cond:
            call.asked(asked)
        while True:
            with self._cond:
                left = deadline - time.monotonic()
                if not call.waiting or left <= 0 or not ep.open:
                    break
                self._cond.wait(min(left, 0.05))
            if time.monotonic() >= look:
                # a peer that left meanwhile (closed, and said so) will not answer: stop waiting
                # for it (a look at the store each LEFT_LOOK_S, only while someone is silent)
                look = time.monotonic() + LEFT_LOOK_S
                with self._cond:
                    silent = call.silent()
                gone = [peer for peer in silent if self._left(peer)]
                with self._cond:
                    for peer in gone:
                        call.gone(peer)
        with self._cond:
            silent = call.silent()
            for name in names:
                self._withdrawals.pop(name, None)
        if silent:
            log.warning(
                "%s withdrawn; %s did not confirm within %.3g s and may still write there",
                f"region {names[0]}" if len(names) == 1 else f"{len(names)} regions",
                ", ".join(silent),
                timeout,
            )
        with self.lock:
            still = [x for x, _ in self._regions.values()]
            for tensor in tensors:
                ep.mem.release_explicit(tensor, still_used=still)
        return silent

    def _left(self, peer: str) -> bool:
        """``peer`` closed: it has no record, and the store says its incarnation we reach (or
        the last one) left. Nobody there can write, and a message to a connection of ours that
        outlived it would only make the backend log the loss; the connection goes too. A record
        that is merely missing (a store that restarted empty) is not enough: such a peer is
        asked, as is every peer when the store cannot tell."""
        directory = self._ep.directory
        try:
            if directory.fetch(peer) is not None:
                return False
            gone = directory.left(peer)
        except (StoreError, WireFormatError):
            return False
        conn = self._peers.get(peer)
        if gone is None or (conn is not None and conn.generation > gone):
            return False
        if conn is not None:
            self._peers.drop(conn)
        return True

    # -- answering the peers' withdrawals ----------------------------------------------------

    def _on_message(self, peer: str, payload: bytes) -> None:
        """Engine thread: bookkeeping only; the housekeeping thread does the rest."""
        try:
            m = Withdraw.decode(payload)
        except WireFormatError as e:
            log.warning("dropping a withdraw message from %s: %s", peer, e)
            return
        if m.kind == "dropped":
            if m.generation != self._ep.generation:
                return
            with self._cond:
                for region in m.regions:
                    call = self._withdrawals.get(region)
                    if call is not None:
                        call.ack(region, peer)
                self._cond.notify_all()
            return
        deadline = time.monotonic() + self._ep.settings.timeout
        with self._cond:
            self._pending.append(_Pending(peer, m.regions, m.generation, deadline, m.revision))
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
                answer = Withdraw("dropped", job.regions, job.generation).encode()
                try:
                    self._control.send_control(job.owner, CHANNEL, answer)
                except TransportError as e:
                    log.info(
                        "could not confirm the withdrawal of %d regions to %s: %s",
                        len(job.regions),
                        job.owner,
                        e,
                    )
            else:
                later.append(job)
        if later:
            with self._cond:
                self._pending.extend(later)
            self._ep.wake.set()  # look again soon

    def _stop_using(self, job: _Pending) -> bool:
        """Stop every plan on the withdrawn regions; True once none is in flight."""
        conn = self._peers.get(job.owner)
        if conn is None or conn.generation != job.generation:
            return True  # never wrote to that incarnation
        return self._plans.stop_regions(conn, job.regions, job.revision)

    def close(self) -> None:
        self._stop_listening()
        with self._cond:
            self._cond.notify_all()
