"""Discovery: the store layout of a namespace, peer records, membership and heartbeats.

Keys live under ``transport/<namespace>/``:

* ``peers/<name>``  the signed peer record (wire.PeerRecord)
* ``gen/<name>``    a counter: each incarnation of a name takes the next generation
* ``members/count``, ``members/<i>``, ``members/by-name/<name>``: the membership
  index, which works on stores that cannot list keys
* ``hb/<name>``     the last heartbeat (generation and wall time), a signed value (``security/signed.py``)
* ``left/<name>``   the generation of ``name`` that last closed (signed): who will not answer
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from transport.errors import StoreError, WireFormatError
from transport.security import signed
from transport.security.sealing import Keys, keys_for
from transport.store.base import Store
from transport.store.counters import Counter, clock_floor, index_counter
from transport.wire import (
    NAME_RE,
    PeerRecord,
    decode_heartbeat,
    decode_peer_record,
    encode_heartbeat,
    encode_peer_record,
    record_generation,
)

log = logging.getLogger(__name__)

#: decoded records kept (by their stored bytes) for the peers fetched most recently, and the
#: memory they may hold together (estimated by :func:`decoded_bytes`; the newest is always kept)
DECODED_RECORDS = 64
DECODED_BYTES = 256 << 20
#: memory of one decoded region besides its name (its RegionInfo, shape and numbers; measured
#: with tracemalloc, 4-dimensional shapes)
REGION_BYTES = 250
#: our own records larger than this are read back whole only every FULL_CHECK_EVERY checks (and
#: checked to exist at every one): a model's record is a megabyte, a heartbeat a second
SMALL_RECORD = 64 << 10
FULL_CHECK_EVERY = 16
#: how many times ``leave`` reads and judges again a record, heartbeat or ``left`` mark rewritten
#: between its read and its compare_delete (or compare_set) before it leaves the value there
LEAVE_TRIES = 8
#: the longest a closing Transport waits for a write of its record or heartbeat in flight
RETIRE_WAIT = 10.0
#: likewise for ``restore`` and ``heartbeat``: how many times they read and judge again a record
#: or heartbeat rewritten between their read and their compare_set before they skip the write
WRITE_TRIES = 8


class Directory:
    """One namespace of a store, seen by one peer: peer records (signed with ``secret`` when
    there is one; ``fetch`` checks the signature, the namespace and the name), generation
    counters, the membership index and heartbeats.

    It keeps the store, the namespace and the secret, the counters it used (which remember the
    garbage they warned about), the bytes of the records it wrote and the last records it decoded
    (so an unchanged record of megabytes is not decoded again): every call is one or more store
    round trips, as thread-safe as the store, and off the hot path (the Transport resolves peers
    and heartbeats with it, never on the engine thread). Generations and the membership index only grow (``names`` lists every name
    that ever joined, live or not); ``leave`` deletes a record only if no newer incarnation has
    replaced it. A counter holding garbage never stops a join or a listing: see
    :meth:`generation_counter` and :meth:`members_counter` for how each is repaired.

    Our own values (one incarnation per value, DESIGN.md's failure model): ``restore`` and
    ``heartbeat`` never write over a newer incarnation's record or heartbeat, and write with
    ``compare_set`` of the very bytes they read and judged, so one written in between stays.
    Once :meth:`retire` has run for a name, nothing of that name is written any more
    (``publish``, ``restore`` and ``heartbeat`` do nothing): the closing peer retires before it
    leaves, so that no write of its housekeeping threads lands after ``leave`` removed them.
    """

    def __init__(self, store: Store, namespace: str, secret: bytes | None) -> None:
        self.store = store
        self.namespace = namespace
        self.secret = secret
        self.prefix = f"transport/{namespace}/"
        self._counters: dict[str, Counter] = {}
        # the bytes we last wrote for each of our records, and the last records decoded (by
        # their stored bytes): a model's record is megabytes, decoded once, not every heartbeat
        self._written: dict[str, bytes] = {}
        self._decoded: OrderedDict[str, tuple[bytes, PeerRecord, int]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._checks: dict[str, int] = {}  # restore() calls per record name
        # our record's and heartbeat's writes check _retired and write under _own_lock: retire()
        # waits there for the write in flight, and no later one writes
        self._own_lock = threading.Lock()
        self._retired: set[str] = set()
        self._admit_lock = threading.Lock()
        self.keys: Keys | None = keys_for(secret, namespace) if secret else None

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)

    def heartbeat_key(self, name: str) -> str:
        """The key of ``name``'s heartbeat (a layer reads it ahead with its own keys)."""
        return self.key("hb", name)

    def generation_counter(self, name: str) -> Counter:
        """The counter of ``name``'s generations; garbage there is repaired by a joiner only
        (``_generation_floor`` says to what, and why that is safe). Readers (``generation``) only
        ignore it: a reader that raised the counter past the live owner's generation would make
        every peer take that owner for restarted."""
        key = self.key("gen", name)
        counter = self._counters.get(key)
        if counter is None:
            what = f"the generations of peer {name!r}"
            counter = self._counters.setdefault(
                key, Counter(self.store, key, what, lambda: self._generation_floor(name))
            )
        return counter

    def members_counter(self) -> Counter:
        """The count of the membership index; garbage there is repaired by a reader or a joiner
        (``index_counter`` says to what, and why that is safe)."""
        key = self.key("members", "count")
        counter = self._counters.get(key)
        if counter is None:
            what = f"the members of namespace {self.namespace!r}"
            counter = self._counters.setdefault(
                key, index_counter(self.store, self.key("members", ""), what)
            )
        return counter

    def _generation_floor(self, name: str) -> int:
        """What a generation counter holding garbage is repaired to: the largest of the clock in
        milliseconds and the generations of ``name`` its record and heartbeat show.

        Why that is safe: a new incarnation must get a generation larger than every one handed
        out before, or its records (peer record, group entries, the publisher's list of dead
        incarnations, a lease) would be taken for an older incarnation's. Generations counted up
        by one from 1 never reach the clock in milliseconds (``clock_floor``); a live peer's
        generation that an earlier repair took past this host's clock is in the record and the
        heartbeat it rewrites every interval. A shown generation over twice the clock cannot
        have been handed out that way: it is garbage too, and ignored (else it could push the
        counter to its limit)."""
        clock = clock_floor()
        shown = [clock]
        try:
            rec = self.fetch(name)
            if rec is not None:
                shown.append(rec.generation)
        except WireFormatError:
            pass
        beat = self.last_heartbeat(name)
        if beat is not None:
            shown.append(beat[0])
        return max(g for g in shown if g <= 2 * clock)

    def join(self, name: str) -> int:
        """Take the next generation of ``name`` and make sure the name is in the membership index.

        A counter the store does not hold starts at :meth:`_generation_floor` (the clock in
        milliseconds, or above): either no incarnation of ``name`` came before, or the store lost
        the counter (it restarted empty) while none was alive to put it back. Counting from 0
        again would hand out a generation an earlier incarnation had, and whoever remembers that
        one (a connection, a publisher's list of lost subscribers) would take the new incarnation
        for the old."""
        counter = self.generation_counter(name)
        if counter.missing():
            counter.raise_to(self._generation_floor(name))
        gen = counter.add(1)
        self._enlist(name)
        return gen

    def _enlist(self, name: str) -> None:
        """Put ``name`` in the membership index, once."""
        if self.store.try_get(self.key("members", "by-name", name)) is None:
            idx = self.members_counter().add(1)
            self.store.set(self.key("members", str(idx)), name.encode())
            self.store.set(self.key("members", "by-name", name), str(idx).encode())

    def publish(self, record: PeerRecord) -> None:
        """Write our record ``record`` (a new revision, or its first); nothing once retired."""
        raw = encode_peer_record(record, self.secret)
        with self._own_lock:
            if record.name in self._retired:
                return
            self.store.set(self.key("peers", record.name), raw)
            self._written[record.name] = raw

    def retire(self, name: str, timeout: float) -> bool:
        """From now on write nothing of ``name`` (our own peer): its ``publish``, ``restore``
        and ``heartbeat`` do nothing. A closing peer calls it before :meth:`leave`: a write of
        its housekeeping threads (or of an expose racing the close) that landed after leave
        removed the record and heartbeat would make the closed peer look alive until its
        heartbeat aged out.

        Each of those writes checks and writes under one lock, so this waits for the one in
        flight (a store call, or the few of a restore, each within the store's deadline), at
        most ``timeout`` seconds. False if that ran out: ``name`` is retired all the same, but
        the write in flight may still land (the caller says so)."""
        got = self._own_lock.acquire(timeout=timeout)
        try:
            self._retired.add(name)
        finally:
            if got:
                self._own_lock.release()
        return got

    def written(self, name: str) -> bytes | None:
        """The bytes of our record ``name`` as we last stored them (sealed with a secret)."""
        return self._written.get(name)

    def admit(self, raw: bytes) -> PeerRecord:
        """A peer's record received out of band (in a connection URL or a memory descriptor of
        torch's transport API), checked as a stored one is (its seal with a secret, the
        namespace), and stored under its name so that lookups find it, unless the store holds
        that incarnation at the same or a newer revision (an older copy never rolls a record
        back) or it is one of our own records. The name joins the membership index, so that our
        withdrawals reach that peer too. Returns the record now stored."""
        if not isinstance(raw, bytes):
            raise TypeError(f"a peer record is bytes, not {type(raw).__name__}")
        rec = decode_peer_record(raw, self.secret, self.namespace)
        if rec.name in self._written:
            raise WireFormatError(
                f"a record of {rec.name!r}, this very peer, came from outside; a peer is "
                "connected to others, not to itself"
            )
        with self._admit_lock:
            key = self.key("peers", rec.name)
            held = self.store.try_get(key)
            if held is not None and held != raw:
                try:
                    current: PeerRecord | None = self._decode(rec.name, held)
                except WireFormatError:
                    current = None  # garbage in the store: the checked record replaces it
                if current is not None and (current.generation, current.revision) >= (
                    rec.generation,
                    rec.revision,
                ):
                    return current
            self.store.set(key, raw)
            self._enlist(rec.name)
        return rec

    def _decode(self, name: str, raw: bytes) -> PeerRecord:
        """``raw`` (the stored record of ``name``) decoded, from the cache when it is the same
        bytes as last time (a record only changes when its peer exposes more or restarts)."""
        with self._cache_lock:
            hit = self._decoded.get(name)
            if hit is not None and hit[0] == raw:
                self._decoded.move_to_end(name)
                return hit[1]
        rec = decode_peer_record(raw, self.secret, self.namespace)
        cost = decoded_bytes(rec)
        with self._cache_lock:
            self._decoded[name] = (raw, rec, cost)
            self._decoded.move_to_end(name)
            held = sum(c for _, _, c in self._decoded.values())
            while len(self._decoded) > 1 and (
                len(self._decoded) > DECODED_RECORDS or held > DECODED_BYTES
            ):
                _, (_, _, dropped) = self._decoded.popitem(last=False)
                held -= dropped
        return rec

    def depart(self, name: str, generation: int, wait: float) -> None:
        """A closing Transport's side of the namespace: retire the name (no write of its record
        or heartbeat lands after; the one in flight is waited for, at most ``wait`` seconds),
        then leave. Never raises: a store that cannot be reached is logged."""
        if not self.retire(name, wait):
            log.warning(
                "transport %s: a write of its record or heartbeat was still in flight when it "
                "left the namespace; it may land after (readers judge it by age)",
                name,
            )
        try:
            self.leave(name, generation)
        except Exception as e:
            log.warning("could not remove %s from the store: %s", name, e)

    def leave(self, name: str, generation: int) -> None:
        """Remove our record and heartbeat, unless a newer incarnation of the name has replaced
        them. The ``left`` mark goes first: a reader that finds no record finds the mark (the
        notifications this incarnation sent before it went are still its own); it is raised to
        our generation, never lowered (``_mark_left``).

        Each value is deleted with ``compare_delete`` of the very bytes read and judged ours (or
        garbage), never with a plain delete: a newer incarnation that writes its record or
        heartbeat between our read and our delete keeps it (else it would vanish from the
        namespace while alive). A value rewritten in between is read and judged again (our own
        heartbeat thread may beat once more while we close), up to LEAVE_TRIES times."""
        key = self.key("peers", name)
        raw = self.store.try_get(key)
        marked = False
        if raw is None:  # the store lost it (restarted empty): readers must still learn we left
            self._mark_left(name, generation)
            marked = True
        for _ in range(LEAVE_TRIES):
            if raw is None or self._generation_of(name, raw, generation) != generation:
                break  # gone, or a newer (or older) incarnation's: not ours to delete
            if not marked:
                self._mark_left(name, generation)
                marked = True
            if self.store.compare_delete(key, raw):
                break
            raw = self.store.try_get(key)
        else:
            self._gave_up(key, name, generation)
        hb = self.heartbeat_key(name)
        for _ in range(LEAVE_TRIES):
            raw = self.store.try_get(hb)
            if raw is None:
                return
            beat = self._heartbeat(name, raw)
            if beat is not None and beat[0] > generation:
                return  # a newer incarnation's goes on beating
            if self.store.compare_delete(hb, raw):
                return
        self._gave_up(hb, name, generation)

    def _generation_of(self, name: str, raw: bytes, ours: int) -> int:
        """The generation of the record ``raw`` of ``name``; ``ours`` for garbage (which the
        leaving incarnation removes as its own)."""
        try:
            return self._decode(name, raw).generation
        except WireFormatError:
            return ours

    def _gave_up(self, key: str, name: str, generation: int) -> None:
        log.warning(
            "%s#%d left the namespace but %s was rewritten %d times while it removed it; "
            "it stays (its readers judge it by generation and age)",
            name,
            generation,
            key,
            LEAVE_TRIES,
        )

    def _mark_left(self, name: str, generation: int) -> None:
        """Raise the ``left`` mark of ``name`` to ``generation``; never lower it. An incarnation
        that leaves late (its close ran after a newer one had already left) finds the newer
        mark and leaves it, so the mark only ever goes up: whoever reads it learns the newest
        incarnation that left. The mark is replaced with ``compare_set`` of the very bytes read
        and judged lower (or missing, or not valid), so a higher one written in between stays;
        a mark rewritten between every read and write is left as it is after LEAVE_TRIES."""
        key = self.key("left", name)
        mark = signed.encode(self.keys, key, name, generation, b"")
        for _ in range(LEAVE_TRIES):
            raw = self.store.try_get(key)
            if raw is not None:
                stored = self._left_of(name, raw)
                if stored is not None and stored >= generation:
                    return  # this incarnation's mark, or a newer one's: it stands
            if self.store.compare_set(key, raw, mark):
                return
        log.warning(
            "%s#%d left the namespace but its mark %s was rewritten %d times while it raised "
            "it; it stays as it is",
            name,
            generation,
            key,
            LEAVE_TRIES,
        )

    def left(self, name: str) -> int | None:
        """The generation of ``name`` that last left the namespace by closing (None: none did,
        or the store lost it, or the value is not valid). The mark only goes up (``leave``)."""
        raw = self.store.try_get(self.key("left", name))
        return None if raw is None else self._left_of(name, raw)

    def _left_of(self, name: str, raw: bytes) -> int | None:
        """The generation the stored ``left`` mark ``raw`` of ``name`` says; None when it is not
        valid (malformed, not signed with the secret, another peer's: logged)."""
        key = self.key("left", name)
        try:
            value = signed.decode(self.keys, key, raw, f"the leave of {name!r}")
        except WireFormatError as e:
            log.warning("ignoring %s", e)
            return None
        return value.generation if value.writer == name else None

    def fetch(self, name: str) -> PeerRecord | None:
        """The current record of ``name`` (None if there is none). WireFormatError for a bad one."""
        raw = self.store.try_get(self.key("peers", name))
        if raw is None:
            return None
        rec = self._decode(name, raw)
        if rec.name != name:
            raise WireFormatError(f"the record stored for peer {name!r} names peer {rec.name!r}")
        return rec

    def names(self) -> list[str]:
        """Every name that ever joined the namespace (live or not), in joining order."""
        count = self.members_counter().value()
        out: list[str] = []
        for i in range(1, count + 1):
            raw = self.store.try_get(self.key("members", str(i)))
            if raw is None:
                continue
            name = raw.decode(errors="replace")
            if not NAME_RE.match(name):
                log.warning(
                    "skipping member %d of namespace %s: %r is not a peer name (key %s)",
                    i,
                    self.namespace,
                    name[:80],
                    self.key("members", str(i)),
                )
                continue
            if name not in out:
                out.append(name)
        return out

    def generation(self, name: str) -> int | None:
        """The newest generation of ``name`` handed out; None while its counter holds garbage."""
        return self.generation_counter(name).read()

    def restore(self, record: PeerRecord) -> bool:
        """Put our record back if the store lost it (a Redis restarted without persistence), or
        holds one we did not write (garbage, a forgery, a record of another incarnation that
        is not newer): the generation counter, the membership index and the record. True if it
        was put back. A record over SMALL_RECORD is read back whole at every FULL_CHECK_EVERY-th
        call only; the others check that it exists.

        The record is written with ``compare_set`` of the very bytes read and judged (None where
        it read none), never with a plain set: a newer incarnation of the name that writes its
        record between our read and our write keeps it (else the live peer's record would be
        the old incarnation's). What is found rewritten is read and judged again, up to
        WRITE_TRIES times. Nothing is written once the name is retired (:meth:`retire`)."""
        key, written = self.key("peers", record.name), self._written.get(record.name)
        n = self._checks[record.name] = self._checks.get(record.name, 0) + 1
        raw: bytes | None
        if written is not None and len(written) > SMALL_RECORD and n % FULL_CHECK_EVERY:
            raw = written if self.store.exists(key) else None
        else:
            raw = self.store.try_get(key)
        ours: bytes | None = None
        repaired = False
        for _ in range(WRITE_TRIES):
            if raw is not None and (raw == written or not self._replaceable(record, raw)):
                return False  # what we wrote, or a newer incarnation's
            if ours is None:
                ours = encode_peer_record(record, self.secret)
            with self._own_lock:
                if record.name in self._retired:
                    return False
                if not repaired:
                    # Our record is missing, garbage or an older incarnation's, so ours is the
                    # newest incarnation the store shows: garbage in the counter is set to our
                    # generation (a joiner takes the next one after it), and the membership index
                    # gets us back. (A store that lost the record may have lost or spoiled these
                    # too, whatever the record's key holds now.)
                    self.generation_counter(record.name).raise_to(record.generation)
                    self._enlist(record.name)
                    repaired = True
                if self.store.compare_set(key, raw, ours):
                    self._written[record.name] = ours
                    return True
            raw = self.store.try_get(key)
        log.warning(
            "the record of %s was rewritten %d times while it put its own back; left as it is",
            record.name,
            WRITE_TRIES,
        )
        return False

    def _replaceable(self, record: PeerRecord, raw: bytes) -> bool:
        """Whether ``raw``, stored as the record of ``record.name`` and not the bytes we wrote,
        may be replaced by ``record``: garbage or a record of an incarnation that is not newer
        (logged). Only its generation is read, never the memory map it lists: a record a store
        writer made as large as the limits allow costs nothing."""
        try:
            stored = record_generation(raw, self.secret, self.namespace)
        except WireFormatError as e:
            log.warning(
                "the record of %s in the store is not valid (%s); writing ours again",
                record.name,
                e,
            )
            return True
        if stored > record.generation:
            return False  # a newer incarnation of the name: not ours to replace
        log.warning(
            "the record of %s in the store is not the one it wrote; writing it again", record.name
        )
        return True

    def heartbeat(self, name: str, generation: int, at: float | None = None) -> bool:
        """Write the heartbeat of ``name`` (of ``generation``): now, or at wall time ``at``.
        True if written; False over a newer incarnation's heartbeat (the name was restarted
        elsewhere, and that one beats for it now), once the name is retired (:meth:`retire`),
        or if the heartbeat was rewritten at every one of WRITE_TRIES reads (logged).

        It replaces the very bytes it read and judged with ``compare_set`` (None where it read
        none), so a newer incarnation's heartbeat written in between stays. The time it writes is
        taken after that read, just before the write: a read the network held for seconds (a
        link cut, then healed) never lands a heartbeat as old as the wait."""
        key = self.heartbeat_key(name)
        for _ in range(WRITE_TRIES):
            raw = self.store.try_get(key)
            if raw is not None:
                beat = self._heartbeat(name, raw)
                if beat is not None and beat[0] > generation:
                    return False
            body = encode_heartbeat(generation, time.time() if at is None else at)
            value = signed.encode(self.keys, key, name, generation, body)
            with self._own_lock:
                if name in self._retired:
                    return False
                if self.store.compare_set(key, raw, value):
                    return True
        log.warning(
            "the heartbeat of %s#%d was rewritten %d times while it beat; this beat is skipped",
            name,
            generation,
            WRITE_TRIES,
        )
        return False

    def last_heartbeat(self, name: str) -> tuple[int, float] | None:
        """The last heartbeat of ``name`` (generation, wall time); None when there is none or it
        is not valid (malformed, not signed with the secret, another peer's: logged)."""
        raw = self.store.try_get(self.heartbeat_key(name))
        return None if raw is None else self._heartbeat(name, raw)

    def _heartbeat(self, name: str, raw: bytes) -> tuple[int, float] | None:
        """The heartbeat of ``name`` stored as ``raw``; None when it is not valid (logged)."""
        key = self.heartbeat_key(name)
        try:
            value = signed.decode(self.keys, key, raw, f"the heartbeat of {name!r}")
            gen, t = decode_heartbeat(value.body)
            if value.writer != name or value.generation != gen:
                raise WireFormatError(
                    f"it is signed by {value.writer}#{value.generation}, not by {name} itself"
                )
        except WireFormatError as e:
            log.warning("ignoring the heartbeat of %s: %s", name, e)
            return None
        return gen, t


def decoded_bytes(rec: PeerRecord) -> int:
    """About how much memory ``rec`` holds once decoded (what the cache of records counts)."""
    names = sum(len(r.name) for r in rec.regions)
    return rec.stored_bytes + len(rec.metadata) + names + REGION_BYTES * len(rec.regions)


__all__ = ["Directory", "StoreError"]
