"""What publishers and subscribers of a weight group say to each other, and where they meet.

Store keys, under ``transport/<namespace>/groups/<group>/``:

* ``epoch``: bumped by every join and leave, so a publisher notices changes with one read
* ``members/count``, ``members/<i>``, ``members/by-name/<name>``: every name that ever joined
* ``sub/<name>``: the subscriber's entry (generation, mode, slots, relay) while it is in the group

Control messages travel as notifications on channel ``ws/<group>``: msgpack maps on the wire, the
typed values of ``_messages`` (named here in brackets) in the code.

* publisher -> subscriber ``{"k": "hello"}`` (Hello): tell me which slots I may write
* publisher -> subscriber ``{"k": "begin", "v": N, "s": slot}`` (Begin): version N is being
  written
* publisher -> subscriber ``{"k": "ver", "v": N, "s": slot}`` (Ver): the notification of the data
  put: every tensor of version N has landed in ``slot``
* subscriber -> publisher ``{"k": "credit", "s": [slots], "v": newest}`` (Credit): the slots it
  may write now
* publisher -> subscriber ``{"k": "abort", "v": N, "s": slot}`` (Abort): the write of version N
  into ``slot`` was given up (its deadline passed, or its relay failed): a ``ver`` of it that
  still comes is ignored, so a slot the subscriber credits next is never also a version it
  completes; answered like ``hello``

Relayed fan-out (the publisher's ``fanout`` is ``chain`` or ``tree``):

* publisher -> relay ``{"k": "fwd", "v": N, "t": ms, "to": [[child, slot, relays], ...]}``
  (Forward): write version N into each child's slot (within ``t`` milliseconds) as it lands here;
  ``relays`` (0/1): the child forwards it in turn, so announce each segment to it
* writer -> relay ``{"k": "seg", "v": N, "s": slot, "a": i, "b": j}`` (Segment): the notification
  of one segment of version N: the tensors ``i`` to ``j - 1`` of the relay's names in sorted order
  have landed in ``slot``; the relay forwards them at once (a pipeline: every hop copies while the
  one before it still writes). The writer's last segment carries ``ver`` and is posted only after
  the others have landed, so ``ver`` still means "all of it".
* writer -> relay ``{"k": "part", "v": N, "s": slot, "a": i, "o": offset, "n": bytes}`` (Piece):
  the notification of one piece of a tensor larger than a segment: bytes ``offset`` to
  ``offset + bytes - 1`` of tensor ``i`` have landed; the relay forwards them at once, so one huge
  tensor (an embedding) is pipelined too.
* relay -> publisher ``{"k": "fwdr", "v": N, "c": child, "x": outcome, "e": why}`` (Report): what
  became of one forward: outcome ``""`` (landed), ``"lost"`` (the child went away) or ``"fail"``

A staging subscriber has two slots. It never credits the slot that holds its newest complete
version, nor the slot an ``apply()`` is copying from, nor a slot it is forwarding from, so nobody
writes what is read. The publisher alone hands out the slots of every subscriber (children credit
the publisher, whoever writes them), and it gives a slot written by a relay back only when that
relay has reported on it or is gone, so two writers never share a slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgpack
import torch

from transport.errors import TransferTimeout, WireFormatError
from transport.memory import check_tensor, dtype_name
from transport.store.base import Store
from transport.store.counters import Counter, clock_floor, index_counter
from transport.weights._messages import Begin, Piece, Segment, Ver, encode
from transport.wire import NAME_RE, unpack

log = logging.getLogger("transport.weights")

MODES = ("staging", "inplace")

#: seconds after which a subscriber that has not answered a publisher's hello is asked again
HELLO_AGAIN = 0.5

#: the publisher's own regions (read-only, for late joiners): "<group>@pub/<name>" and the
#: sequence word "<group>@pub/__seq" = [seq (odd while the trainer changes the tensors), version]
PUB_SLOT = "pub"
SEQ_NAME = "__seq"


def check_named_tensors(named: Mapping[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """The tensors of a publisher or subscriber, checked before anything is registered (a
    subscriber's may be meta tensors: shapes and dtypes, whose staging lives elsewhere)."""
    if not named:
        raise ValueError(f"a {role} needs at least one tensor")
    for name, t in named.items():
        if role == "subscriber" and isinstance(t, torch.Tensor) and t.is_meta:
            check_tensor(torch.empty(0, dtype=t.dtype), f"tensor {name!r}")
            continue
        check_tensor(t, f"tensor {name!r}")
    return dict(named)


def match_regions(
    regions: Mapping[str, Any], group: str, tensors: Mapping[str, torch.Tensor], role: str
) -> tuple[list[str], list[str]]:
    """The names of a subscriber's slot-0 regions of ``group`` that ``tensors`` can fill, and
    one problem per region they cannot (missing, or another shape or dtype); ``role`` names the
    side that holds ``tensors`` in the messages."""
    prefix, names, problems = region(group, 0, ""), [], []
    for rname, info in regions.items():
        if not rname.startswith(prefix):
            continue
        n = rname[len(prefix) :]
        t = tensors.get(n)
        if t is None:
            problems.append(f"{n!r}: the {role} has no tensor of that name")
        elif tuple(t.shape) != info.shape or dtype_name(t.dtype) != info.dtype:
            problems.append(
                f"{n!r}: {role} {tuple(t.shape)} {dtype_name(t.dtype)}, subscriber {info.shape} {info.dtype}"
            )
        else:
            names.append(n)
    return names, problems


def channel(group: str) -> str:
    return f"ws/{group}"


def region(group: str, slot: int | str, name: str) -> str:
    return f"{group}@{slot}/{name}"


class GroupDirectory:
    """The store side of a group: the subscribers' entries, the membership index and the epoch,
    under ``transport/<namespace>/groups/<group>/``.

    It keeps the key prefix and the group's two counters: every call is one or more store round
    trips, as thread-safe as the store, and never made on the engine thread. Join and leave bump
    the epoch; the membership index only grows (``names`` drops duplicates); ``leave`` deletes
    the entry only while it is still that generation's; ``entry`` raises WireFormatError for a
    malformed one. Garbage in a counter is repaired by whoever meets it, reader or writer: the
    epoch to the clock in milliseconds, the member count as ``index_counter`` says.
    """

    def __init__(self, store: Store, namespace: str, group: str) -> None:
        self.store = store
        self.prefix = f"transport/{namespace}/groups/{group}/"
        # The epoch only has to differ from every value a publisher saw before a change: the
        # clock in milliseconds does, since join and leave count it up by one from 0
        # (clock_floor), and the publisher that repairs it reads the entries after the repair.
        what = f"the changes of group {group!r}"
        self._epoch = Counter(store, self.prefix + "epoch", what, clock_floor)
        self._members = index_counter(
            store, self.prefix + "members/", f"the members of group {group!r}"
        )

    def epoch(self) -> int:
        return self._epoch.value()

    def join(self, name: str, generation: int, mode: str, slots: int, relay: bool) -> None:
        entry = msgpack.packb(
            {"v": 1, "gen": generation, "mode": mode, "slots": slots, "relay": relay}
        )
        self.store.set(self.prefix + f"sub/{name}", entry)
        if self.store.try_get(self.prefix + f"members/by-name/{name}") is None:
            idx = self._members.add(1)
            self.store.set(self.prefix + f"members/{idx}", name.encode())
            self.store.set(self.prefix + f"members/by-name/{name}", str(idx).encode())
        self._epoch.add(1)

    def declare_layout(self, name: str, layout: bytes | None) -> None:
        """The destination layout subscriber ``name`` declares before it joins (None: whole
        tensors by name; an older incarnation's declaration is removed)."""
        if layout is None:
            self.store.delete(self.prefix + f"layout/{name}")
        else:
            self.store.set(self.prefix + f"layout/{name}", layout)

    def layout(self, name: str) -> bytes | None:
        """The destination layout ``name`` declared (None: it takes whole tensors by name)."""
        return self.store.try_get(self.prefix + f"layout/{name}")

    def leave(self, name: str, generation: int) -> None:
        entry = self.entry(name)
        if entry is not None and entry["gen"] == generation:
            self.store.delete(self.prefix + f"sub/{name}")
            self.store.delete(self.prefix + f"layout/{name}")
            self._epoch.add(1)

    def entry(self, name: str) -> dict[str, Any] | None:
        raw = self.store.try_get(self.prefix + f"sub/{name}")
        if raw is None:
            return None
        m = unpack(raw, f"group entry of {name!r}", 4096, max_str=64, max_map=8)
        if (
            not isinstance(m, dict)
            or set(m) != {"v", "gen", "mode", "slots", "relay"}
            or m["v"] != 1
            or not isinstance(m["relay"], bool)
            or m["mode"] not in MODES
            or m["slots"] not in (1, 2)
            or not isinstance(m["gen"], int)
        ):
            raise WireFormatError(f"malformed group entry of {name!r}: {str(m)[:80]}")
        return m

    def names(self) -> list[str]:
        """The members that ever joined, in joining order; a name that is not a peer name (the
        store's garbage) is skipped with a warning naming its key."""
        count = self._members.value()
        out = []
        for i in range(1, count + 1):
            key = self.prefix + f"members/{i}"
            raw = self.store.try_get(key)
            if raw is None:
                continue
            name = raw.decode(errors="replace")
            if not NAME_RE.match(name):
                log.warning("skipping %s: %r is not a peer name", key, name[:80])
            elif name not in out:
                out.append(name)
        return out

    def entries(self, names: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
        """The entry of every member, or of ``names`` (those that left have none); a malformed
        entry is skipped with a warning naming its key, so one bad entry never stops the group."""
        out = {}
        for name in self.names() if names is None else names:
            try:
                entry = self.entry(name)
            except WireFormatError as e:
                log.warning("skipping %s: %s", self.prefix + f"sub/{name}", e)
                continue
            if entry is not None:
                out[name] = entry
        return out


class Worker:
    """One thread that runs the layer's work off the engine thread (sends, callbacks), and a
    periodic ``tick`` for deadlines: the first right away, the next when the tick says (or after
    the next piece of work), so a layer that never gets work still ticks."""

    def __init__(self, name: str, tick: Callable[[], float | None] | None = None) -> None:
        self._q: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._tick = tick
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        wait: float | None = None if self._tick is None else 0.0
        while True:
            try:
                fn = self._q.get(timeout=wait)
            except queue.Empty:
                fn = None
            else:
                if fn is None:
                    return
                try:
                    fn()
                except Exception:
                    log.exception("weight-sync work failed")
            if self._tick is not None:
                try:
                    wait = self._tick()
                except Exception:
                    log.exception("weight-sync deadline check failed")
                    wait = 0.1

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


#: the size of the segments a version is cut into on its way to a relay
SEGMENT_BYTES = 32 << 20


def pieces(t: torch.Tensor, seg_bytes: int = SEGMENT_BYTES) -> list[tuple[int, int]]:
    """(byte offset, bytes) of the pieces a tensor larger than ``seg_bytes`` travels in, each a
    whole number of elements."""
    size = t.element_size()
    step = max(size, seg_bytes - seg_bytes % size)
    return [(o, min(step, t.nbytes - o)) for o in range(0, t.nbytes, step)]


def piece(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The elements of ``t`` (contiguous) at bytes ``offset`` to ``offset + nbytes - 1``."""
    size = t.element_size()
    return t.reshape(-1)[offset // size : (offset + nbytes) // size]


def segments(tensors: Mapping[str, torch.Tensor], seg_bytes: int = SEGMENT_BYTES) -> list[int]:
    """Where the segments of a relay's tensors (its names in sorted order) begin, and the end:
    consecutive tensors of at least ``seg_bytes`` together; a tensor larger than that is a
    segment of its own (it travels in ``pieces``)."""
    names = sorted(tensors)
    bounds, size = [0], 0
    for i, n in enumerate(names):
        nbytes = tensors[n].nbytes
        if nbytes > seg_bytes and size:
            bounds.append(i)
            size = 0
        size += nbytes
        if size >= seg_bytes and i + 1 < len(names):
            bounds.append(i + 1)
            size = 0
    bounds.append(len(names))
    return bounds


class SegmentedWrite:
    """Writes one version into one slot of a peer in segments, as they become ready: each
    segment is posted at once (announced by a ``seg`` message when the peer relays); the last one
    carries ``ver`` and is posted only once every other one has landed. ``done(error or None)``
    is called once, on ``submit``'s thread, when all of it has landed or the first error is known
    and nothing is in flight any more."""

    def __init__(
        self,
        transport: Any,
        peer: str,
        group: str,
        version: int,
        slot: int,
        deadline: float,
        announce: bool,
        submit: Callable[[Callable[[], Any]], None],
        done: Callable[[BaseException | None], Any],
    ) -> None:
        self.t, self.peer, self.chan = transport, peer, channel(group)
        self.version, self.slot, self.deadline, self.announce = version, slot, deadline, announce
        self.submit, self.done = submit, done
        self._lock = threading.Lock()
        self._pending = 0
        self._last: dict[str, torch.Tensor] | None = None
        self._ended = self._finished = False
        self.error: BaseException | None = None

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"the deadline of version {self.version} passed")
        return left

    def begin(self) -> bool:
        try:
            self.t.core.send_control(self.peer, self.chan, encode(Begin(self.version, self.slot)))
        except Exception as e:
            self.fail(e)
            return False
        return True

    def add(self, a: int, b: int, batch: Mapping[str, torch.Tensor]) -> None:
        """Post the tensors ``a`` to ``b - 1`` (in the peer's sorted names) now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            if self.announce:
                msg = encode(Segment(self.version, self.slot, a, b))
                h = self.t.core.put_control(batch, self.peer, self.chan, msg, self._left())
            else:
                h = self.t.put(dict(batch), self.peer, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def add_part(self, a: int, key: str, t: torch.Tensor, offset: int, nbytes: int) -> None:
        """Post bytes ``offset`` to ``offset + nbytes - 1`` of ``t`` (tensor ``a`` in the peer's
        sorted names) into the same bytes of the peer's region ``key`` now."""
        with self._lock:
            if self.error is not None or self._ended:
                return
            self._pending += 1
        try:
            src, at = piece(t, offset, nbytes), offset // t.element_size()
            if self.announce:
                msg = encode(Piece(self.version, self.slot, a, offset, nbytes))
                h = self.t.core.put_control_at(
                    src, key, at, self.peer, self.chan, msg, self._left()
                )
            else:
                h = self.t.put(src, self.peer, key, offset=at, timeout=self._left())
        except Exception as e:
            self._landed(e)
            return
        h.add_done_callback(lambda h: self.submit(lambda: self._landed(h.exception(0))))

    def end(self, last: Mapping[str, torch.Tensor]) -> None:
        """The rest (possibly nothing), with ``ver``, once every segment posted so far landed."""
        with self._lock:
            self._ended, self._last = True, dict(last)
        self._landed(None, count=False)

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._ended = True
        self._landed(None, count=False)

    def _landed(self, error: BaseException | None, count: bool = True) -> None:
        with self._lock:
            if count:
                self._pending -= 1
            if error is not None and self.error is None:
                self.error = error
            if not self._ended or self._pending or self._finished:
                return
            self._finished = True
            last, err = self._last, self.error
        if err is None:
            try:
                msg = encode(Ver(self.version, self.slot))
                if last:
                    h = self.t.core.put_control(last, self.peer, self.chan, msg, self._left())
                    h.add_done_callback(lambda h: self.submit(lambda: self.done(h.exception(0))))
                    return
                self.t.core.send_control(self.peer, self.chan, msg)
            except Exception as e:
                err = e
        self.done(err)
