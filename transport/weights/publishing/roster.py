"""The publisher's side of a group's membership: the roster of its subscribers, read from the
store (each one's view in members.py), the fan-outs, and the watch of their heartbeats."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from transport import Batch, TransportError
from transport.contract import stale_after, without_gc
from transport.weights.group.group_directory import GroupDirectory, GroupEntry
from transport.weights.group.messages import MAX_DEGREE, Hello, encode
from transport.weights.group.region_names import (
    channel,
    exposed_slots,
    inbox_region,
    inplace_mark,
    match_regions,
    region,
)
from transport.weights.peer_watch import PeerWatch
from transport.weights.publishing.delivery import EXCLUDED, Delivery
from transport.weights.publishing.members import (
    Member,
    PublisherMember,
    RankMember,
    Retired,
    replaced_why,
)
from transport.weights.relay_tree import parent_of

if TYPE_CHECKING:
    from transport import Transport
    from transport.contract import PeerView

log = logging.getLogger(__name__)


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


def fanout_tree(subs: list[PublisherMember], fanout: str, degree: int) -> dict[str, str]:
    """The chain or tree over ``subs``: subscriber -> the relay that writes it (the others the
    publisher writes; none with ``"direct"``). The tree has one root (weights/relay_tree.py):
    the publisher writes the first; subscriber ``i`` goes under subscriber ``(i - 1) // k``
    (``k`` = 1 for a chain, ``degree`` for a tree). Relays
    come first, by name, so that every publish to the same members builds the same tree (and the
    relays reuse their prepared transfers). A subscriber goes under a relay only if the relay
    holds every tensor it takes."""
    if fanout == "direct":
        return {}
    order = sorted(subs, key=lambda s: (not s.can_relay, s.name))
    k = 1 if fanout == "chain" else degree
    via = {}
    for i in range(1, len(order)):
        up = parent_of(i, 1, k)
        assert up is not None
        parent = order[up]
        if parent.can_relay and order[i].names <= parent.names:
            via[order[i].name] = parent.name
    return via


M = TypeVar("M", bound=Member)


class Roster(Generic[M]):
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
        member_type: type[M],
        planner: Callable[[RankMember, PeerView], str] | None = None,
        unpacked: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.transport = transport
        self.group = group
        self.tensors = tensors
        # the trainer's own tensors where ``tensors`` holds packed copies of some of them
        # (WeightPublisher's pack): written as they are to a member whose connection copies in
        # the kernel (PeerView.kernel_copies), where many descriptors cost no more than one
        self.unpacked = unpacked
        # how a sharded rank plans a member (sets its ``writes``; returns what is wrong, or "")
        self.planner = planner
        self.member_type = member_type  # what each publisher keeps of a member
        self.dir = GroupDirectory(transport.core.signed, transport.namespace, group)
        self._watch = PeerWatch(transport)  # the members' heartbeats
        self.members: dict[str, M] = {}
        self.lost: dict[str, int] = {}  # name -> generation of a subscriber that went away
        self.epoch = -1  # the group's epoch when it was last read
        self.reread = False  # read every entry at the next refresh, whatever the epoch
        self.store_lost = False  # the store lost the group since the last refresh
        # the batches of the name sets members asked for, per slot: made (checked, signed) once
        # for every member taking the same names (usually all of them take every name)
        self._batches: dict[tuple[frozenset[str], bool], list[Batch]] = {}

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
            if self.lost.get(name, -1) >= entry.generation:
                continue  # died without leaving the group (or an older incarnation's, put back)
            seen.add(name)
            sub = self.members.get(name)
            if sub is None or sub.entry != entry or sub.error:  # any change: planned again
                self.members[name] = self.plan(name, entry, sub)
                if sub is not None:
                    gone.append(Retired(sub, replaced_why(sub, entry.generation), lost=False))
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

    def replan(self, sub: M) -> M | None:
        """Plan ``sub`` again (its error may have passed) from its entry as the store holds it
        now (a newer incarnation's, if one joined; the one it was planned from while the store
        has none): the new Member in its place, or None (``sub.error`` then says why not, as
        it is now). One store read, and a connect."""
        entry = self.dir.entry(sub.name)
        if entry is None or self.lost.get(sub.name, -1) >= entry.generation:
            entry = sub.entry
        new = self.plan(sub.name, entry, sub)
        if new.error:
            sub.error, sub.transient = new.error, new.transient
            return None
        self.members[sub.name] = new
        return new

    def grace(self) -> float:
        """How long a member whose entry the store lost is served before it counts as left."""
        return stale_after(self.transport.heartbeat_interval)

    def lose(self, sub: M) -> bool:
        """``sub`` went away (its peer was lost): dropped until a newer incarnation joins. False
        if it was no longer a member."""
        if self.members.get(sub.name) is not sub:
            return False
        del self.members[sub.name]
        self.lost[sub.name] = sub.generation
        self.reread = True
        return True

    @without_gc
    def plan(self, name: str, entry: GroupEntry, before: M | None) -> M:
        """A new member for ``entry`` (``member_type``: a :class:`RankMember` a sharded rank
        plans with ``planner``, a :class:`PublisherMember` whose tensors are matched by name):
        connected afresh (``error`` says why it cannot be served; ``before``, the member it
        replaces, keeps a repeated error from being logged at every publish)."""
        sub = self.member_type(name, entry)
        conn = self._connect(sub, before)
        if conn is None:
            return sub
        if isinstance(sub, RankMember):
            self._plan_rank(sub, conn, before)
        elif isinstance(sub, PublisherMember):
            self._plan_names(sub, conn, before)
        return sub

    def _plan_names(self, sub: PublisherMember, conn: PeerView, before: Member | None) -> None:
        """A publisher's member: the tensors it exposes matched by name, then asked for its
        free slots (staging)."""
        name = sub.name
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
            return
        sub.names = frozenset(names)
        sub.unpacked = self.unpacked is not None and conn.kernel_copies
        sub.batches = self.batches(sub.names, names, sub.slots, sub.unpacked)
        inbox = conn.regions.get(inbox_region(self.group))
        sub.inbox = inbox.nbytes if inbox is not None and inbox.writable else 0
        if sub.mode == "staging":
            self._hello(sub)

    def _connect(self, sub: Member, before: Member | None) -> PeerView | None:
        """Connect to ``sub`` afresh and check that its record agrees with its entry: what the
        connection shows, or None (``sub.error`` says why)."""
        name = sub.name
        try:
            # Read its record afresh: a connection made before it subscribed lacks the group's
            # regions, and one to an older incarnation is stale.
            conn = self.transport.core.peer(name, refresh=True)
        except TransportError as e:
            sub.error = f"cannot connect (tried again until the deadline): {e}"
            sub.transient = True
            return None
        if conn.generation != sub.generation:
            sub.error = (
                f"its record is of generation {conn.generation}, its group entry of "
                f"{sub.generation} (tried again until the deadline)"
            )
            sub.transient = True
            return None
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
            return None
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
            return None
        return conn

    def _plan_rank(self, sub: RankMember, conn: PeerView, before: Member | None) -> None:
        """A sharded rank's member: planned by the rank's ``planner`` (which sets its
        ``writes``), then asked for its free slots (in place too: its credits say which versions
        it completed)."""
        assert self.planner is not None
        try:
            sub.error = self.planner(sub, conn)
        except Exception as e:  # what a subscriber declared must never stop a publish
            sub.error = (
                f"subscriber {sub.name!r} cannot be planned ({type(e).__name__}: {e}; tried "
                "again at the next publish)"
            )
            if before is None or before.error != sub.error:
                log.exception("group %s: planning subscriber %r failed", self.group, sub.name)
        else:
            if sub.error and (before is None or before.error != sub.error):
                log.error("group %s: %s", self.group, sub.error)
        self._hello(sub)

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

    def batches(
        self, names_set: frozenset[str], names: list[str], slots: int, unpacked: bool = False
    ) -> list[Batch]:
        """The batches of ``names`` for slots 0 to ``slots - 1`` (checked and signed once: a
        publish does no per-tensor work), from ``unpacked`` or from ``tensors``, shared by
        members of the same names. At most 8 are kept: members that each take other names are
        not a cache's case."""
        key = (names_set, unpacked)
        src = self.unpacked if unpacked and self.unpacked is not None else self.tensors
        made = self._batches.get(key, [])
        for k in range(len(made), slots):
            made.append(self.transport.batch({region(self.group, k, n): src[n] for n in names}))
        self._batches[key] = made
        while len(self._batches) > 8:
            del self._batches[next(iter(self._batches))]
        return made[:slots]

    def suspects(self, members: Iterable[Member]) -> dict[str, str]:
        """Why each of ``members`` is suspect now, by its heartbeat (one store read each)."""
        return self._watch.suspects({sub.name: sub.generation for sub in members})


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
        roster: Roster[Any],
        lock: threading.RLock,
        handles: Callable[[], Iterable[Delivery]],
        interval: float,
        cut_off: Callable[[Any, str], bool] = lambda sub, why: False,
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
                    if sub.waiting is not None and not sub.waiting.handle.waits_for(sub.name):
                        sub.waiting = None  # never started later, with the next one's bytes
        return self.interval
