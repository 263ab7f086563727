"""Withdrawing an exposed region (``Transport.unexpose``) without a writer writing into it after.

The owner takes the region out of its record, then tells every peer of the namespace
(``{"k": "withdraw", "r": region, "g": generation}`` on the control channel ``tx/withdraw``). A
peer stops using the region at once (its plans on it are invalidated, so new puts fail with
RegionError), waits until the transfers it had posted into it have ended, and answers
``{"k": "dropped", ...}``. Once every peer has answered, or at the timeout, the owner deregisters
the memory (unless another exposed region shares it) and ``unexpose`` returns the peers that did
not answer: only they may still write there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import msgpack

from transport.errors import TransportError, WireFormatError
from transport.wire import unpack

if TYPE_CHECKING:
    from transport._transport import Transport

log = logging.getLogger("transport")

CHANNEL = "tx/withdraw"


def encode(kind: str, region: str, generation: int) -> bytes:
    out: bytes = msgpack.packb({"k": kind, "r": region, "g": generation}, use_bin_type=True)
    return out


def decode(payload: bytes) -> tuple[str, str, int]:
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
    return m["k"], m["r"], m["g"]


class Withdrawals:
    """One Transport's side of ``unexpose``, both ways: withdrawing its own regions
    (:meth:`withdraw`) and answering its peers' withdrawals (the handler of ``tx/withdraw``).

    It owns the answers awaited per region being withdrawn and the withdrawals still to answer;
    ``_cond`` guards both. Threads: :meth:`withdraw` runs on the caller's thread and blocks;
    ``_on_message`` runs on the engine thread and only records (never the Transport's lock);
    :meth:`run` runs on the control thread, which stops the plans and answers. The timeout bounds
    the wait only: at it the memory is deregistered all the same and the silent peers are
    returned; answers that come later, or name another generation of ours, are ignored. A writer
    answers once nothing of its own is in flight into the region, or at its own timeout.
    """

    def __init__(self, t: Transport) -> None:
        self.t = t
        self._cond = threading.Condition()
        self._acks: dict[str, set[str]] = {}  # region being withdrawn -> peers that answered
        self._pending: list[tuple[str, str, int, float]] = []  # (owner, region, gen, deadline)
        t._on_control(CHANNEL, self._on_message)

    # -- the owner's side ------------------------------------------------------------------------

    def withdraw(self, name: str, timeout: float) -> list[str]:
        t = self.t
        with t._lock:
            t._check_open()
            entry = t._regions.get(name)
            if entry is None:
                raise KeyError(
                    f"region {name!r} is not exposed by {t.name!r} (exposed: {sorted(t._regions)[:10]})"
                )
            tensor, info = entry
            del t._regions[name]
            t._local_names.pop((info.addr, info.nbytes), None)
            with self._cond:
                self._acks[name] = set()
            t._publish()  # new readers of the record no longer see it
        peers = [n for n in t._dir.names() if n != t.name]
        asked = []
        for peer in peers:
            try:
                t._send_control(peer, CHANNEL, encode("withdraw", name, t.generation))
            except TransportError:
                continue  # not there (left, or never connected to a live incarnation)
            asked.append(peer)
        t.recorder.record("withdraw", peers=tuple(asked), nbytes=info.nbytes, keys=name)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not set(asked) <= self._acks[name]:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            silent = sorted(set(asked) - self._acks.pop(name))
        if silent:
            log.warning(
                "region %s withdrawn; %s did not confirm within %.3g s and may still write it",
                name,
                ", ".join(silent),
                timeout,
            )
        with t._lock:
            t._mem.release_explicit(tensor, still_used=[x for x, _ in t._regions.values()])
        return silent

    # -- the writers' side -----------------------------------------------------------------------

    def _on_message(self, peer: str, payload: bytes) -> None:
        """Engine thread: bookkeeping only; the control thread does the rest."""
        try:
            kind, region, gen = decode(payload)
        except WireFormatError as e:
            log.warning("dropping a withdraw message from %s: %s", peer, e)
            return
        if kind == "dropped":
            with self._cond:
                acks = self._acks.get(region)
                if acks is not None and gen == self.t.generation:
                    acks.add(peer)
                    self._cond.notify_all()
            return
        with self._cond:
            self._pending.append((peer, region, gen, time.monotonic() + self.t.timeout))
        self.t._control_wake.set()

    def run(self) -> None:
        """Control thread: drop what was withdrawn; answer once nothing is in flight into it."""
        with self._cond:
            if not self._pending:
                return
            jobs, self._pending = self._pending, []
        later = []
        for owner, region, gen, deadline in jobs:
            if self._drop(owner, region, gen) or time.monotonic() > deadline:
                try:
                    self.t._send_control(owner, CHANNEL, encode("dropped", region, gen))
                except TransportError as e:
                    log.info("could not confirm the withdrawal of %s to %s: %s", region, owner, e)
            else:
                later.append((owner, region, gen, deadline))
        if later:
            with self._cond:
                self._pending.extend(later)
            self.t._control_wake.set()  # look again soon

    def _drop(self, owner: str, region: str, gen: int) -> bool:
        """Stop every plan on ``region`` of ``owner`` (new puts re-plan and fail with RegionError);
        release the idle ones; True once none is in flight."""
        t = self.t
        conn = t._conns.get(owner)
        if conn is None or conn.generation != gen:
            return True  # never wrote to that incarnation
        with conn.lock:
            conn.regions.pop(region, None)
            for plan in conn.plans:
                if region in plan.regions:
                    plan.valid = False  # no new use; the cache lets go of it below
        with t._lock:
            stopped = [(k, p) for k, p in t._plans.items() if p.conn is conn and not p.valid]
            return all([t._forget_plan(k, p) for k, p in stopped])
