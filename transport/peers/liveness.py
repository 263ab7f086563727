"""Liveness: when a peer's heartbeats say that it may be gone. One definition for every reader of
heartbeats: ``peers()`` and ``wait_for_peer()`` (``PeerInfo.suspect``), the weight-sync publisher
(a suspect subscriber is left out of a publish at once) and the publisher lease (a holder silent
for much longer has lost its lease).

Every Transport writes ``hb/<name>`` (its generation and its wall-clock time) every
``heartbeat_interval``. A heartbeat is *stale* once it is older than ``beats`` heartbeat intervals
and at least ``floor`` seconds: the floor keeps a loaded host (a heartbeat thread that runs
late), a short interval or a modest clock skew between two hosts from making a live peer look
gone. There are two bars:

* **suspect** (:data:`SUSPECT_BEATS`, :data:`SUSPECT_MIN_S`): acting on it is cheap and undone
  by the next heartbeat (a publish leaves the peer out; the next one tries it again);
* **gone** (:data:`GONE_BEATS`, :data:`GONE_MIN_S`): acting on it cannot be undone (another
  publisher takes over its lease), so the bar is higher.

A stale heartbeat is not enough when the reader heard from that incarnation within the same bar
(a frame it sent us, proven its own: ``ControlChannel.heard``): a busy process's heartbeat
thread may run seconds late (a 2-core host running several vLLM servers: over 5 s, measured)
while its engine answers; a frozen or partitioned peer sends nothing, so it is still found.

Rules: the age is judged with the reader's clock and the reader's ``heartbeat_interval``, so
give the peers of a namespace the same interval (a peer that beats less often than its readers
expect looks suspect between its beats). A peer with no heartbeat of its incarnation in the store
(it is starting, or the store restarted empty and it has not beaten since) is not suspect:
suspicion needs a heartbeat that stopped, or a newer incarnation beating in its place.
"""

from __future__ import annotations

import time

#: a peer whose last heartbeat is older than this many heartbeat intervals, and than
#: SUSPECT_MIN_S seconds, is suspect (frozen, overloaded, partitioned or dead)
SUSPECT_BEATS = 3
SUSPECT_MIN_S = 5.0
#: a publisher lease's holder silent for this many intervals, and GONE_MIN_S seconds, is gone
GONE_BEATS = 10
GONE_MIN_S = 10.0


def stale_after(interval: float, beats: int = SUSPECT_BEATS, floor: float = SUSPECT_MIN_S) -> float:
    """The age in seconds past which a heartbeat is stale, for readers beating every ``interval``."""
    return max(floor, beats * interval)


def staleness(
    last: float,
    interval: float,
    *,
    now: float | None = None,
    beats: int = SUSPECT_BEATS,
    floor: float = SUSPECT_MIN_S,
) -> str | None:
    """Why a heartbeat written at ``last`` (wall clock) is stale, or None if it is recent enough."""
    age = (time.time() if now is None else now) - last
    limit = stale_after(interval, beats, floor)
    if age <= limit:
        return None
    return (
        f"its last heartbeat is {age:.1f} s old (more than {limit:g} s: {beats} heartbeat "
        f"intervals of {interval:g} s, at least {floor:g} s); it may be frozen, overloaded, "
        "partitioned or dead"
    )


def suspicion(
    heartbeat: tuple[int, float] | None,
    generation: int,
    interval: float,
    now: float | None = None,
    heard: float | None = None,
) -> str | None:
    """Why incarnation ``generation`` of a peer is suspect, given the heartbeat the store holds
    for its name (generation, wall time) and when the reader last heard from that incarnation
    (``heard``, wall time: a frame it sent, proven its own), or None if it is not (see the
    module's rules)."""
    if heartbeat is None or heartbeat[0] < generation:
        return None  # no heartbeat of this incarnation yet: nothing stopped
    if heartbeat[0] > generation:
        return f"it restarted: generation {heartbeat[0]} beats in the place of {generation}"
    why = staleness(heartbeat[1], interval, now=now)
    if why is not None and heard is not None and staleness(heard, interval, now=now) is None:
        return None  # it answered: its engine runs, its heartbeat thread runs late
    return why
