"""The one place the tests reach into private state: what a test must observe or provoke that no
public call (nor ``transport.core``) shows. Each helper says what it is for; ruff's SLF001
(private member access) is off for this file only, so a new private access shows up here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import transport
from transport.backends.base import Backend
from transport.memory.local import LocalMemory
from transport.peers.conn import PeerConn
from transport.progress_engine import Op, ProgressEngine
from transport.store import MemoryStore
from transport.transfers.lanes import Lane
from transport.transfers.plan import Plan
from transport.weights.group.group_directory import GroupDirectory, GroupEntry

# -- a Transport's parts --------------------------------------------------------------------------


def connection(t: transport.Transport, peer: str) -> PeerConn | None:
    """The cached connection to ``peer`` (alive or not): which incarnation a put would use."""
    return t._peers.get(peer)


def connection_count(t: transport.Transport) -> int:
    """Connections held (a peer that left must not leave one behind)."""
    return len(t._peers)


def drop_connection(t: transport.Transport, conn: PeerConn) -> None:
    """What housekeeping does when the store shows a newer incarnation of ``conn``'s peer."""
    t._peers.drop(conn)


def hold_restart_drops(t: transport.Transport) -> Callable[[], None]:
    """From now on ``t``'s housekeeping keeps its connections to peers that restarted (a
    Transport that has not noticed a restart yet: its next message to the peer meets the
    incarnation before); the returned call lets it drop them again."""
    table = t._peers
    original = table.drop_restarted
    table.drop_restarted = lambda: None  # type: ignore[method-assign]

    def release() -> None:
        table.drop_restarted = original  # type: ignore[method-assign]

    return release


def plans(t: transport.Transport) -> list[Plan]:
    """The cached plans, least recently made first."""
    return t._plans.plans()


def backend(t: transport.Transport) -> Backend:
    """The Transport's own agent (to spy on or fail its calls)."""
    return t._ep.backend


def local_memory(t: transport.Transport) -> LocalMemory:
    """The registration cache of the Transport's own agent (its limits, its size)."""
    return t._ep.mem


def lanes(t: transport.Transport) -> list[Lane]:
    """The lanes started so far (none until a transfer needs them)."""
    return t._transfers.lanes.lanes


def engine(t: transport.Transport) -> ProgressEngine:
    """The Transport's own progress engine."""
    return t._engine


def engine_interval(e: ProgressEngine, in_flight: bool) -> float:
    """How long the engine's loop would sleep now if it held a transfer in flight (or none):
    the rule of its polls, read without a transfer to hold."""
    saved = e._inflight
    e._inflight = [Op.__new__(Op)] if in_flight else []
    try:
        return e._sleep_for(time.monotonic())
    finally:
        e._inflight = saved


def doorbell_woken(e: ProgressEngine) -> bool:
    """Whether the engine's next sleep returns at once (a wake-up is pending)."""
    return bool(e.doorbell._woken)


def engine_ops(e: ProgressEngine) -> list[Op]:
    """The ops an engine holds: in flight and queued."""
    return [*e._inflight, *e._queue]


def control_channel(t: transport.Transport) -> Any:
    """The notifications' channel (its bound on queued notifications)."""
    return t._control


def queued_notifications(t: transport.Transport) -> tuple[int, int]:
    """How many unread notifications ``t`` holds, and their payload bytes."""
    control = control_channel(t)
    with control._cond:
        return len(control._queue), control._queued_bytes


def transfers(t: transport.Transport) -> Any:
    """The transfer paths (to spy on one of them with monkeypatch)."""
    return t._transfers


def install_stream_ops(t: transport.Transport, ops: Any) -> None:
    """Stream machinery of a test's own (a host-memory stand-in of the GPU's words)."""
    t._transfers.stream = ops


def idle_counts(t: transport.Transport, seconds: float) -> dict[str, Any]:
    """What ``t``'s process did over ``seconds`` of doing nothing: the turns of its engine loop
    (``engine``: each sleep it came back from), the voluntary context switches of each of its
    threads (``threads``: name -> count; threads of no Python name, NIXL's and UCX's, are
    ``native-<id>``), the rings its doorbell took and refused, and the CPU seconds of the whole
    process. Upper bounds on these hold on a loaded host: load makes a sleeping thread come back
    later, never sooner (involuntary switches, which load adds, are not counted)."""
    from transport.cli.bench._util import thread_wakeups

    e = t._engine
    turns, rings, refused = e.wakeups, e.doorbell.rings, e.doorbell.refused
    before, cpu = thread_wakeups(), time.process_time()
    time.sleep(seconds)  # sync-ok: the window counted, not a wait for another thread
    after = thread_wakeups()
    return {
        "engine": e.wakeups - turns,
        "threads": {n: c - before.get(n, 0) for n, c in after.items()},
        "rings": e.doorbell.rings - rings,
        "refused": e.doorbell.refused - refused,
        "cpu": time.process_time() - cpu,
    }


def doorbell(t: transport.Transport) -> tuple[str, int, bytes, int, int]:
    """Where ``t``'s doorbell listens, its token, and the rings it took and refused so far."""
    d = t._engine.doorbell
    assert d.bell is not None
    return d.bell.ip, d.bell.port, d.bell.token, d.rings, d.refused


def wait_rings(t: transport.Transport, n: int, timeout: float) -> int:
    """Wait until ``t``'s doorbell took ``n`` rings in all (or ``timeout`` passed); the count."""
    d, end = t._engine.doorbell, time.monotonic() + timeout
    while d.rings < n and time.monotonic() < end:
        time.sleep(0.01)  # sync-ok: polls a counter the engine bumps, until the caller's timeout
    return d.rings


def hold_record_restore(t: transport.Transport) -> Callable[[], None]:
    """Keep ``t``'s housekeeping from putting its record back in the store (it goes on beating)
    until the returned call: a store that restarted empty, seen before the owner's next round."""
    regions = t._regions
    restore = regions.restore
    held = threading.Event()
    held.set()
    regions.restore = lambda: False if held.is_set() else restore()  # type: ignore[method-assign]
    return held.clear


def hold_engine_posts(t: transport.Transport, hold: Callable[[Op], None]) -> None:
    """Call ``hold(op)`` before the engine posts each op it posts itself (not the caller's)."""
    e = t._engine
    post = e._post

    def held(op: Op, lost_raises: bool = False) -> None:
        hold(op)
        post(op, lost_raises)

    e._post = held  # type: ignore[method-assign]


def hold_notified_posts(t: transport.Transport) -> None:
    """From now on the engine never posts an op that carries a notification: every byte of a
    version lands, its completion never goes (for a test that kills the process then, without
    racing the transfer). Only for transfers the engine thread posts (not small inline ones)."""
    held = threading.Event()  # never set: the process is killed while its engine waits

    def hold(op: Op) -> None:
        if op.notif:
            held.wait()

    hold_engine_posts(t, hold)


def hold_completions(
    t: transport.Transport, reached: threading.Event | None = None, let_through: int = 0
) -> None:
    """From now on a sharded publisher's ``ver`` (a version's completion, a control message
    sent once its writes landed) never leaves ``t``, after the first ``let_through`` of them:
    every byte of a version lands, its completion never goes (for a test that kills the process
    then). ``reached`` is set when a ``ver`` is held (every byte of that part landed)."""
    from dataclasses import replace

    from transport.weights.group.messages import Ver, decode

    held = threading.Event()  # never set: the process is killed while the sender waits
    send = t.core.send_control
    passed = [0]

    def holding(peer: str, channel: str, payload: bytes) -> None:
        try:
            is_ver = isinstance(decode(payload), Ver)
        except Exception:
            is_ver = False
        if is_ver and passed[0] < let_through:
            passed[0] += 1
        elif is_ver:
            if reached is not None:
                reached.set()
            held.wait()
        send(peer, channel, payload)

    t.core = replace(t.core, send_control=holding)


def staging_buffers(sub: transport.WeightSubscriber) -> list[Any]:
    """Weak references to the flat buffers a subscriber's staging slots are views of."""
    import weakref

    bases = {}
    for slot in sub.staging:
        for t in slot.values():
            base = t._base if t._base is not None else t
            bases[id(base)] = base
    return [weakref.ref(b) for b in bases.values()]


# -- stores and weight groups --------------------------------------------------------------------


def empty_memory_store(store: MemoryStore) -> None:
    """Every key of ``store`` gone at once, as a Redis without persistence restarts."""
    with store._data.changed:
        store._data.values.clear()


def group_entry(t: transport.Transport, group: str, name: str) -> GroupEntry | None:
    """Subscriber ``name``'s entry in ``group`` as the store holds it (None: it has none)."""
    return GroupDirectory(t.store, t.namespace, group).entry(name)


# -- a weight subscriber --------------------------------------------------------------------------


def control_handler(sub: transport.WeightSubscriber) -> Callable[[str, bytes], None]:
    """The subscriber's handler of control messages (to feed it messages directly)."""
    return sub._on_message


def pretend_slot_holds(sub: transport.WeightSubscriber, version: int) -> None:
    """Make every slot of the subscriber say it holds ``version`` (a lost base, for a test of
    the refusal of changes)."""
    with sub._lock:
        slots = sub._slots
        assert slots.newest is not None
        slots.version = [version] * slots.count


def newest_slot(sub: transport.WeightSubscriber) -> int | None:
    """The staging slot of the newest complete version."""
    with sub._lock:
        return sub._slots.newest


def slot_state(
    sub: transport.WeightSubscriber,
) -> tuple[int | None, int | None, list[int], list[int]]:
    """Under the subscriber's lock: the newest complete version's slot (None once it was handed
    back to the publisher: applied, and no longer readable), the slot apply() holds, the slots
    read by forwards in progress, and each slot's version."""
    with sub._lock:
        slots = sub._slots
        forwarding = sorted(k for k, n in slots.forwarding.items() if n)
        newest = None if slots.handed_back else slots.newest
        return newest, slots.held, forwarding, list(slots.version)


def spy_on_messages(
    sub: transport.WeightSubscriber,
    t: transport.Transport,
    channel: str,
    spy: Callable[[Callable[[str, bytes], None], str, bytes], None],
) -> None:
    """Put ``spy(original, peer, payload)`` in the subscriber's place on its control channel
    (``original`` checks the sender first, as the subscriber does)."""
    original = sub._admit
    sub._stop_control()
    sub._stop_control = t.core.on_control(channel, lambda p, m: spy(original, p, m))


def hold_forwards(sub: transport.WeightSubscriber) -> Callable[[], int]:
    """From now on the subscriber's relay keeps every forward a publisher asks of it, neither
    started nor reported (a relay that holds a forward, as one does while the version has not
    arrived); the returned call hands them over as they came and says how many."""
    relay = sub._relay
    original, held = relay.on_fwd, []
    relay.on_fwd = lambda peer, m: held.append((peer, m))  # type: ignore[method-assign]

    def release() -> int:
        relay.on_fwd = original  # type: ignore[method-assign]
        for peer, m in held:
            original(peer, m)
        return len(held)

    return release


def hold_patches(sub: transport.WeightSubscriber) -> Callable[[], int]:
    """From now on the subscriber neither applies nor answers the changes written into its
    inbox (a subscriber that stalls before its ``patched``); the returned call stops holding
    and says how many it held (they are dropped: their writers' deadlines settle them)."""
    original, held = sub._patch, []
    sub._patch = lambda peer, m: held.append((peer, m))  # type: ignore[method-assign]

    def release() -> int:
        sub._patch = original  # type: ignore[method-assign]
        return len(held)

    return release


def hold_entry_checks(sub: transport.WeightSubscriber) -> Callable[[], None]:
    """From now on the subscriber does not put its group entry back in a store that lost it;
    the returned call lets it do so again."""
    directory = sub._dir
    original = directory.check_in
    directory.check_in = lambda *args, **kwargs: ""  # type: ignore[method-assign]

    def release() -> None:
        directory.check_in = original  # type: ignore[method-assign]

    return release


def unknown_senders(sub: transport.WeightSubscriber) -> list[str]:
    """The senders whose messages the subscriber holds until the store knows them."""
    with sub._upstream._lock:
        return sorted(sub._upstream._unknown)


def busy_gpu(cycles: int) -> None:
    """A GPU kernel that keeps the current stream busy for about ``cycles`` clock cycles."""
    torch.cuda._sleep(cycles)  # sync-ok: a GPU kernel that orders the stream, no host wait


def record_revision(t: transport.Transport) -> int:
    """The revision of the record ``t`` published last."""
    rec = t._regions.record
    assert rec is not None
    return rec.revision


def count_control_messages(t: transport.Transport, channel: str) -> Callable[[], int]:
    """Count the control messages ``t`` sends on ``channel`` from now on (the returned call reads
    the count)."""
    control = t._control
    real = control.send_control
    count = [0]

    def counting(peer: str, chan: str, payload: bytes) -> None:
        if chan == channel:
            count[0] += 1
        real(peer, chan, payload)

    control.send_control = counting
    return lambda: count[0]


def hold_sender_checks(t: transport.Transport) -> tuple[Callable[[], int], threading.Event]:
    """Without a secret: hold ``t``'s housekeeping thread before it checks the senders of the
    notifications it holds (in the store), until the returned event is set, so that a test
    orders a sender's departure before that check. Also returns how many frames wait for it."""
    control = t._control
    real = control.check_senders
    gate = threading.Event()

    def gated() -> None:
        if control._senders._held:
            gate.wait(120)
        real()

    control.check_senders = gated  # type: ignore[method-assign]
    return lambda: held_frames(t), gate


def count_record_reads(t: transport.Transport) -> dict[str, int]:
    """Count the reads of peer records ``t``'s store client makes from now on (peer name ->
    reads): what a flood of agents costs it in store round trips."""
    directory = t._ep.directory
    store = directory.store
    real = store.try_get
    counts: dict[str, int] = {}
    prefix = directory.key("peers", "")

    def counting(key: str) -> bytes | None:
        if key.startswith(prefix):
            name = key[len(prefix) :]
            counts[name] = counts.get(name, 0) + 1
        return real(key)

    store.try_get = counting  # type: ignore[method-assign]
    return counts


def held_frames(t: transport.Transport) -> int:
    """Notification frames ``t`` holds while it checks their senders (no secret)."""
    return t._control._senders._frames


def rank_parts(sub: transport.WeightSubscriber) -> list[tuple[int, list[int]]]:
    """Under the subscriber's lock: each version of a sharded trainer some of whose ranks'
    parts landed, with those ranks (a version is dropped from this once it completes)."""
    with sub._lock:
        return sorted((version, sorted(ranks)) for (version, _), ranks in sub._ranks.parts.items())


def after_lease_ensure(pub: transport.weights.ShardedPublisher, then: Callable[[], None]) -> None:
    """Call ``then`` right after ``pub`` puts its lease back at each publish: where a store
    writer racing the publisher writes its forgery."""
    lease = pub._lease
    real = lease.ensure

    def ensure() -> None:
        real()
        then()

    lease.ensure = ensure  # type: ignore[method-assign]


def upstream_ranks(sub: transport.WeightSubscriber) -> dict[str, int]:
    """The publishers the subscriber believes, with their ranks, as its last read of the
    group's leases left them."""
    upstream = sub._upstream
    with upstream._lock:
        return dict(upstream._ranks)


def upstream_reads(sub: transport.WeightSubscriber) -> float:
    """When the subscriber's next read of its group's leases is due: it changes as each read
    starts, and the reads run one after the other on the subscriber's worker."""
    return sub._upstream._next_refresh


def mute_withdrawals(t: transport.Transport) -> threading.Event:
    """``t`` takes its peers' withdraw messages and never answers them (as a peer that is asked
    and then goes); the returned event is set when the first arrives."""
    arrived = threading.Event()
    regions = t._regions
    regions._stop_listening()
    t.core.on_control("tx/withdraw", lambda peer, payload: arrived.set())
    return arrived


def deaf_to(t: transport.Transport, peer: str) -> None:
    """Make ``t`` forget hearing from ``peer``, and count nothing it sends from now on as a sign
    of life (what a stopped process leaves, with its last heartbeat: the liveness rule counts
    both; a live subscriber's last message may still be on its way when a test stops it)."""
    control = t._control
    hear = control._hear

    def _hear(name: str, generation: int, frames: list[bytes], at: float | None = None) -> None:
        if name != peer:
            hear(name, generation, frames, at)

    control._hear = _hear
    control._heard.pop(peer, None)


def unpacked_members(pub: Any) -> dict[str, bool]:
    """Which members a WeightPublisher writes from the trainer's own tensors rather than its
    pack (their connections copy in the kernel): the path a test means to take."""
    with pub._lock:
        return {name: sub.unpacked for name, sub in pub._subs.items()}
