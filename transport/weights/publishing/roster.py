"""The publisher's side of a group's membership: its view of each subscriber, the roster of them
it reads from the store, and the fan-outs."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from transport import Batch, TransportError
from transport.contract import stale_after, without_gc
from transport.weights.group.group_directory import GroupDirectory
from transport.weights.group.messages import MAX_DEGREE, Hello, encode
from transport.weights.group.region_names import (
    channel,
    exposed_slots,
    inbox_region,
    inplace_mark,
    match_regions,
    region,
)
from transport.weights.publishing.delivery import EXCLUDED, Delivery

if TYPE_CHECKING:
    from transport import Transport
    from transport.contract import PeerView
    from transport.weights.publishing.write_plan import SlotWrites

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PatchInFlight:
    """A version's changes (``nbytes``) written into a subscriber's inbox for ``slot``, waiting
    for its ``patched``."""

    version: int
    slot: int
    handle: Delivery
    nbytes: int


@dataclass(frozen=True)
class Retired:
    """A member incarnation the roster no longer serves, and why: it left, a newer incarnation
    of its name replaced it, or (``lost``) its peer went away."""

    member: Member
    why: str
    lost: bool


def replaced_why(old: Member, generation: int) -> str:
    """Why the member ``old`` was planned again, as incarnation ``generation``."""
    if generation != old.generation:
        return f"a newer incarnation of it (generation {generation}) joined"
    if old.error:
        return f"it is planned again ({old.error})"
    return "it joined again with another group entry"


class Member:
    """The publisher's view of one subscriber incarnation: what it takes (``names``, the
    ``batches`` per slot), what went wrong when it was planned (``error``: it is planned again at
    the next publish), since when its group entry is missing from a store that lost the group
    (``vanished``), its free slots (``credits``), the slot being written and by whom, the version
    waiting for a slot, the slots fenced off for a relay that was cut off while writing them, and
    the segments of a version in flight. The publisher changes it under its own lock only."""

    def __init__(
        self, name: str, generation: int, mode: str, slots: int, relay: bool, instance: int = 0
    ) -> None:
        self.name, self.generation, self.mode, self.slots = name, generation, mode, slots
        self.instance = instance  # which subscriber of that incarnation (its group entry says)
        self.entry = (generation, instance, mode, slots, relay)  # as its group entry said
        self.can_relay = relay and mode == "staging"
        self.names: frozenset[str] = frozenset()
        self.batches: list[Batch] = []
        self.error = ""
        # ``error`` may pass by itself (no record or connection yet: a store that restarted
        # empty, a peer still starting): planned again while a version waits for it
        self.transient = False
        self.vanished: float | None = None  # monotonic time its entry was found missing
        self.asked = time.monotonic()  # when we last said hello (asked for free slots)
        self.credits: set[int] = set(range(slots)) if mode == "inplace" else set()
        self.completed = -1  # the newest version that landed there
        self.held: dict[int, int] = {}  # credited slot -> the version it holds whole (staging)
        self.inbox = 0  # bytes of its delta inbox (0: it takes versions whole only)
        self.delta_key: object = None  # a sharded rank's key of its layout (weights/delta/ranks.py)
        self.patch: PatchInFlight | None = None  # changes written, waiting for ``patched``
        self.started = 0.0  # when the write of ``busy`` began
        self.busy: int | None = None  # slot being written
        self.writing = -1  # the version being written into it
        # a version waiting for a credit, and the relay to write it (None: the publisher)
        self.waiting: tuple[int, Delivery, str | None] | None = None
        self.relay: str | None = None  # the relay writing ``busy``, which only it can give back
        self.relay_handle: Delivery | None = None
        # slots a relay was cut off while writing (slot -> (relay, version)): nobody else
        # writes them until that relay reports on this subscriber or is gone
        self.fenced: dict[int, tuple[str, int]] = {}
        self.lend_asked = -1  # the newest version it was asked to lend a slot for
        self.segments: dict[int, list[tuple[int, int, dict[str, torch.Tensor]]]] = {}
        # a sharded trainer's rank (weights/publishing/sharded.py): what it writes per slot, the newest
        # version the subscriber completed and settled (its credits), the version this rank
        # last began there, and the one whose completion it waits to hear of
        self.writes: list[SlotWrites] = []
        self.newest = -1
        self.settled = -1
        self.last = -1
        self.acked: tuple[int, int, Delivery] | None = None
        # no longer served (left, replaced by a newer incarnation, lost): what completes for it
        # later is settled, and nothing more is sent to its name on its account
        self.retired = False

    def free_slot(self) -> int | None:
        """A slot the publisher may write now: credited, neither being written nor fenced."""
        busy = {self.busy} if self.busy is not None else set()
        free = sorted(self.credits - busy - set(self.fenced))
        return free[0] if free else None

    def take_patch(self, version: int, slot: int | None = None) -> PatchInFlight | None:
        """The changes in flight that a ``patched`` (or their put's end) of ``version`` in
        ``slot`` (None: any) answers, no longer in flight; None if it answers none."""
        p = self.patch
        if p is None or p.version != version or (slot is not None and p.slot != slot):
            return None
        self.patch = None
        return p

    def unfence(self, relay: str, version: int | None = None) -> None:
        """``relay`` reported on this subscriber (on ``version`` or a later one: its writes here
        have drained) or is gone (``version`` None): the slots fenced for it are free again."""
        for slot, (r, v) in list(self.fenced.items()):
            if r == relay and (version is None or version >= v):
                del self.fenced[slot]

    def no_slot(self, version: int) -> str:
        """Why ``version`` found no slot free here within its deadline."""
        if self.error:
            return self.error
        if not self.fenced:
            return f"no free slot within the deadline of version {version} (a slow apply?)"
        cut = ", ".join(f"{r} (since version {v})" for r, v in sorted(self.fenced.values()))
        return (
            f"no free slot within the deadline of version {version}: one is fenced for "
            f"relay {cut}, cut off while writing it, until it reports or is gone; the other "
            "holds its newest version, which it had not applied (so it could not lend it)"
        )


FANOUTS = ("direct", "chain", "tree")


def check_fanout(fanout: object, degree: object) -> tuple[str, int]:
    if fanout not in FANOUTS:
        raise ValueError(f"fanout must be one of {FANOUTS}, got {fanout!r}")
    if not isinstance(degree, int) or isinstance(degree, bool) or not 1 <= degree <= MAX_DEGREE:
        raise ValueError(
            f"degree (subscribers each writer serves in a tree) must be an int from 1 to "
            f"{MAX_DEGREE}, got {degree!r}"
        )
    return str(fanout), degree


def fanout_tree(subs: list[Member], fanout: str, degree: int) -> dict[str, str]:
    """The chain or tree over ``subs``: subscriber -> the relay that writes it (the others the
    publisher writes; none with ``"direct"``). The publisher writes the first; subscriber ``i``
    goes under subscriber ``(i - 1) // k`` (``k`` = 1 for a chain, ``degree`` for a tree). Relays
    come first, by name, so that every publish to the same members builds the same tree (and the
    relays reuse their prepared transfers). A subscriber goes under a relay only if the relay
    holds every tensor it takes."""
    if fanout == "direct":
        return {}
    order = sorted(subs, key=lambda s: (not s.can_relay, s.name))
    k = 1 if fanout == "chain" else degree
    via = {}
    for i in range(1, len(order)):
        parent = order[(i - 1) // k]
        if parent.can_relay and order[i].names <= parent.names:
            via[order[i].name] = parent.name
    return via


class Roster:
    """The subscribers of one group as the publisher serves them: one :class:`Member` per
    subscriber incarnation, planned (connected afresh, its tensors matched) when it joins.

    It owns ``members`` (name -> Member), the incarnations that were lost (skipped until a newer
    one joins), the group epoch it read last and whether it must read the whole group again. The
    publisher calls it under its own lock; a refresh is a few store round trips, plus a connect
    per member it plans. Rules:

    * an entry of a new name, generation or instance is planned (a subscriber that closed and
      one made after it on the same Transport are two members, whatever they take); a member
      whose entry was deleted (the epoch moved forward) left, and is dropped at once;
    * every member incarnation it stops serving (left, or replaced by a newer incarnation of
      its name) is returned by :meth:`refresh` as :class:`Retired`, and one whose peer was lost
      goes through :meth:`lose`: the publisher settles what it held for it and hands back the
      children it was to write, so nothing stays held for an incarnation that is gone;
    * a member that could not be planned (``error``: no record, no connection, a record of
      another generation, tensors that do not match) is planned again at every refresh while its
      entry is there: a record the store lost comes back, a connect that failed may succeed;
      one whose error may pass by itself (``transient``) is planned again (:meth:`replan`)
      while a version waits for it, until that version's deadline;
    * the store lost the group (it restarted empty) when the epoch goes back, or when the
      publisher found its lease missing (``store_lost``: the joins after the restart may have
      counted the epoch back up to the value read before): the members whose entries vanished
      are kept, and served over their connections (which need no store), until they join again
      (the same incarnation: nothing to plan) or for at most
      ``liveness.stale_after(heartbeat_interval)`` seconds from that loss; after that they
      count as left;
    * a name whose incarnation was lost is skipped until an entry of a newer generation comes
      (generations never repeat, even across a store that lost its counters: see
      ``PeerDirectory.join``);
    * :meth:`suspects` reads each member's heartbeat: a suspect one (transport/peers/liveness.py) is
      left out of that publish at once, and tried again at the next.
    """

    def __init__(
        self,
        transport: Transport,
        group: str,
        tensors: Mapping[str, torch.Tensor],
        planner: Callable[[Member, PeerView], str] | None = None,
    ) -> None:
        self.transport = transport
        self.group = group
        self.tensors = tensors
        # how a sharded rank plans a member (sets its ``writes``; returns what is wrong, or "")
        self.planner = planner
        self.dir = GroupDirectory(transport.core.signed, transport.namespace, group)
        self.members: dict[str, Member] = {}
        self.lost: dict[str, int] = {}  # name -> generation of a subscriber that went away
        self.epoch = -1  # the group's epoch when it was last read
        self.reread = False  # read every entry at the next refresh, whatever the epoch
        self.store_lost = False  # the store lost the group since the last refresh
        # the batches of the name sets members asked for, per slot: made (checked, signed) once
        # for every member taking the same names (usually all of them take every name)
        self._batches: dict[frozenset[str], list[Batch]] = {}

    def refresh(self) -> list[Retired]:
        """Read what changed (see the rules); returns the member incarnations that are gone
        (left, or replaced by a newer incarnation of their name), whose state the publisher
        settles and whose children it hands back."""
        epoch, last = self.dir.epoch(), self.epoch
        full = epoch != last or self.reread or self.store_lost
        # the epoch only grows, unless the store lost the group (restarted empty); the lease,
        # which the publisher checks first at every publish, says so whatever the epoch does
        # (the joins after a restart may have counted it back up to the value read before)
        went_back = 0 <= epoch < last or self.store_lost
        # nothing joined or left: only the members waiting to be planned again, or to come back
        check = (
            list(self.members)
            if full
            else [n for n, s in self.members.items() if s.error or s.vanished is not None]
        )
        if not full and not check:
            return []
        self.epoch, self.reread, self.store_lost = epoch, False, False
        entries = self.dir.entries(None if full else check)
        now, seen, gone = time.monotonic(), set(), []
        for name, entry in entries.items():
            if self.lost.get(name, -1) >= entry["gen"]:
                continue  # died without leaving the group (or an older incarnation's, put back)
            seen.add(name)
            sub = self.members.get(name)
            fields = (entry["gen"], entry["inst"], entry["mode"], entry["slots"], entry["relay"])
            if sub is None or sub.entry != fields or sub.error:  # any change: planned again
                self.members[name] = self.plan(name, entry, sub)
                if sub is not None:
                    gone.append(Retired(sub, replaced_why(sub, entry["gen"]), lost=False))
            else:
                sub.vanished = None  # back in the group
        for name in check:
            sub = self.members.get(name)
            if name in seen or sub is None:
                continue
            if went_back:  # its grace starts now, whether or not it had come back before
                if sub.vanished is None:
                    log.warning(
                        "group %s: the store lost the group (a store that restarted empty?); "
                        "serving %s until it joins again",
                        self.group,
                        name,
                    )
                sub.vanished = now
            elif sub.vanished is None or now - sub.vanished > self.grace():
                log.info("subscriber %s left group %s", name, self.group)
                del self.members[name]
                gone.append(Retired(sub, "it left the group", lost=False))
        return gone

    def replan(self, sub: Member) -> Member | None:
        """Plan ``sub`` again (its error may have passed) from its entry as the store holds it
        now (a newer incarnation's, if one joined; the one it was planned from while the store
        has none): the new Member in its place, or None (``sub.error`` then says why not, as
        it is now). One store read, and a connect."""
        entry = self.dir.entry(sub.name)
        if entry is None or self.lost.get(sub.name, -1) >= entry["gen"]:
            gen, inst, mode, slots, relay = sub.entry
            entry = {"gen": gen, "inst": inst, "mode": mode, "slots": slots, "relay": relay}
        new = self.plan(sub.name, entry, sub)
        if new.error:
            sub.error, sub.transient = new.error, new.transient
            return None
        self.members[sub.name] = new
        return new

    def grace(self) -> float:
        """How long a member whose entry the store lost is served before it counts as left."""
        return stale_after(self.transport.heartbeat_interval)

    def lose(self, sub: Member) -> bool:
        """``sub`` went away (its peer was lost): dropped until a newer incarnation joins. False
        if it was no longer a member."""
        if self.members.get(sub.name) is not sub:
            return False
        del self.members[sub.name]
        self.lost[sub.name] = sub.generation
        self.reread = True
        return True

    @without_gc
    def plan(self, name: str, entry: dict[str, Any], before: Member | None) -> Member:
        """A new Member for ``entry``: connected afresh, its tensors matched (``error`` says why
        it cannot be served; ``before``, the member it replaces, keeps a repeated error from
        being logged at every publish)."""
        sub = Member(
            name, entry["gen"], entry["mode"], entry["slots"], entry["relay"], entry["inst"]
        )
        try:
            # Read its record afresh: a connection made before it subscribed lacks the group's
            # regions, and one to an older incarnation is stale.
            conn = self.transport.core.peer(name, refresh=True)
        except TransportError as e:
            sub.error = f"cannot connect (tried again until the deadline): {e}"
            sub.transient = True
            return sub
        if conn.generation != entry["gen"]:
            sub.error = (
                f"its record is of generation {conn.generation}, its group entry of "
                f"{entry['gen']} (tried again until the deadline)"
            )
            sub.transient = True
            return sub
        exposed = exposed_slots(conn.regions, self.group)
        marked = inplace_mark(self.group) in conn.regions
        if exposed and marked != (sub.mode == "inplace"):
            # only its record says that its memory is written in place: an entry that says
            # otherwise is not its own (a store writer's), and writing in place a slot it reads
            # would tear what it reads
            says = "marks it in place" if marked else "exposes staging slots"
            sub.error = (
                f"its group entry says {sub.mode}, its record {says} (tried again at the next "
                "publish)"
            )
            if before is None or before.error != sub.error:
                log.error("group %s: subscriber %r: %s", self.group, name, sub.error)
            return sub
        if exposed and exposed != sub.slots:
            # the entry is its own (signed), but of another subscriber of this incarnation, put
            # back: writing slots it does not expose, or its only slot in place, would fail or
            # tear what it reads
            sub.error = (
                f"its group entry says {sub.slots} slot(s) ({sub.mode}), its record exposes "
                f"{exposed} (tried again at the next publish)"
            )
            if before is None or before.error != sub.error:
                log.error("group %s: subscriber %r: %s", self.group, name, sub.error)
            return sub
        if self.planner is not None:
            try:
                sub.error = self.planner(sub, conn)
            except Exception as e:  # what a subscriber declared must never stop a publish
                sub.error = (
                    f"subscriber {name!r} cannot be planned ({type(e).__name__}: {e}; tried "
                    "again at the next publish)"
                )
                if before is None or before.error != sub.error:
                    log.exception("group %s: planning subscriber %r failed", self.group, name)
            else:
                if sub.error and (before is None or before.error != sub.error):
                    log.error("group %s: %s", self.group, sub.error)
            self._hello(sub)
            return sub
        names, problems = match_regions(conn.regions, self.group, self.tensors, "publisher")
        if not names and not problems:
            problems.append("it exposes none of the publisher's tensors")
        if problems:
            sub.error = (
                f"subscriber {name!r} does not match ({len(problems)} problems): "
                + "; ".join(problems)
            )
            if before is None or before.error != sub.error:
                log.error("group %s: %s", self.group, sub.error)
            return sub
        sub.names = frozenset(names)
        sub.batches = self.batches(sub.names, names, sub.slots)
        inbox = conn.regions.get(inbox_region(self.group))
        sub.inbox = inbox.nbytes if inbox is not None and inbox.writable else 0
        if sub.mode == "staging":
            self._hello(sub)
        return sub

    def _hello(self, sub: Member) -> None:
        """Ask ``sub`` for its free slots (a sharded rank asks in-place members too: their
        credits say which versions they completed)."""
        if sub.error:
            return
        try:
            self.transport.core.send_control(sub.name, channel(self.group), encode(Hello()))
        except TransportError as e:
            sub.error = f"cannot reach it (tried again until the deadline): {e}"
            sub.transient = True

    def batches(self, key: frozenset[str], names: list[str], slots: int) -> list[Batch]:
        """The batches of ``names`` for slots 0 to ``slots - 1`` (checked and signed once: a
        publish does no per-tensor work), shared by members of the same names. At most 8 name
        sets are kept: members that each take other names are not a cache's case."""
        made = self._batches.get(key, [])
        for k in range(len(made), slots):
            made.append(
                self.transport.batch({region(self.group, k, n): self.tensors[n] for n in names})
            )
        self._batches[key] = made
        while len(self._batches) > 8:
            del self._batches[next(iter(self._batches))]
        return made[:slots]

    def suspects(self, members: Iterable[Member]) -> dict[str, str]:
        """Why each of ``members`` is suspect now, by its heartbeat (one store read each)."""
        out = {}
        for sub in members:
            why = self.transport.core.suspect(sub.name, sub.generation)
            if why:
                out[sub.name] = why
        return out


class SuspectWatch:
    """The heartbeats of the subscribers that publishes in flight still wait for, read every
    ``interval`` seconds (one store read each, outside the publisher's lock) until none is in
    flight: a subscriber that became suspect meanwhile (transport/peers/liveness.py: frozen,
    partitioned, dead) is excluded at once from every version it has no outcome of, with that
    reason, instead of at their deadlines, and so is a child whose relay became suspect. The
    others' outcomes do not wait for it. What was posted to it goes on (a version that lands
    once it runs again is whole, as any); the next publish judges it again. A child whose relay
    became suspect goes to ``cut_off(child, why)`` first, which may close the gap (the publisher
    writes it itself) instead.

    It owns only the time of the next check; ``lock`` is the publisher's, ``handles()`` (called
    under it) the publisher's versions in flight. :meth:`tick` runs on the publisher's worker.
    """

    def __init__(
        self,
        roster: Roster,
        lock: threading.RLock,
        handles: Callable[[], Iterable[Delivery]],
        interval: float,
        cut_off: Callable[[Member, str], bool] = lambda sub, why: False,
    ) -> None:
        self.roster, self.lock, self.handles, self.interval = roster, lock, handles, interval
        self.cut_off = cut_off
        self.next = math.inf

    def tick(self) -> float | None:
        """Check if it is time; the seconds until the next check (None: nothing in flight)."""
        now = time.monotonic()
        with self.lock:
            live = [h for h in self.handles() if not h.done()]
            if not live:
                self.next = math.inf
                return None
            if self.next == math.inf:  # the first check one interval after a publish began
                self.next = now + self.interval
            if now < self.next:
                return self.next - now
            self.next = now + self.interval
            members = self.roster.members
            waiting = [s for s in members.values() if any(s.name in h.pending for h in live)]
            relays = {s.relay for s in waiting if s.relay is not None} - {s.name for s in waiting}
            read = waiting + [members[r] for r in sorted(relays) if r in members]
        if not read:
            return self.interval
        try:
            suspects = self.roster.suspects(read)
        except TransportError as e:
            log.info("group %s: cannot read heartbeats: %s", self.roster.group, e)
            return self.interval
        if suspects:
            with self.lock:
                for sub in waiting:
                    why = suspects.get(sub.name)
                    if why:
                        reason = f"suspect: {why} (tried again at the next publish)"
                    elif sub.relay is not None and sub.relay in suspects:
                        reason = f"its relay {sub.relay} is suspect: {suspects[sub.relay]}"
                        if self.cut_off(sub, reason):
                            continue  # the publisher writes it itself
                    else:
                        continue
                    log.info("group %s: %s excluded: %s", self.roster.group, sub.name, reason)
                    for h in live:
                        h.settle(sub.name, EXCLUDED, reason)
                    if sub.waiting is not None and not sub.waiting[1].waits_for(sub.name):
                        sub.waiting = None  # never started later, with the next one's bytes
        return self.interval
