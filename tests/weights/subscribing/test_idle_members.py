"""Members of a group that wait between versions sleep: subscribers, the relays among them and
the publisher wake a few times a second at most (counted as in tests/core/test_idle.py: upper
bounds that load cannot break), and a version still reaches every one of them, through the
relays, while their engines sleep up to an hour (only the rings of those who write wake them)."""

from __future__ import annotations

import transport
from helpers import internals
from helpers.polling import wait_until
from helpers.ws_peer import MiB, make_tensors, spec_of
from transport.weights import WeightPublisher

SPEC = spec_of(4, MiB // 4)  # 4 MiB in 4 tensors
IDLE_S = 3.0
#: engine turns in IDLE_S: one a second, and a few for what a member's own threads start
MAX_TURNS = 8
#: voluntary switches of any one thread in IDLE_S (a member's once-a-second store checks)
MAX_SWITCHES = 40 * IDLE_S


def _publish(pub, tensors, version):
    for x in tensors.values():
        x.fill_(version)
    return pub.publish(version, timeout=60).wait(90)


def test_idle_members_sleep_and_still_take_every_version(spawn, tcp_store):
    names = ["s1", "s2", "s3"]
    subs = [spawn("sub", n, SPEC, wait=False, idle_interval=3600.0) for n in names]
    for s in subs:
        s.started()
    tensors = make_tensors(SPEC)
    with transport.Transport("trainer", store=tcp_store, idle_interval=3600.0) as t:
        pub = WeightPublisher(t, tensors, fanout="tree", degree=1)
        wait_until(lambda: (pub.refresh(), len(pub.subscribers()))[1] == 3, 60, "3 subscribers")
        for version in (1, 2):
            for s in subs:
                s.call("idle_counts", 0.5)  # every member has gone to sleep
            _publish(pub, tensors, version)
            for s in subs:
                assert s.call("wait_for_version", version, 60) == version
                assert s.call("apply") == version
                assert s.live_values() == {n: (version, version) for n in SPEC}
        for s in subs:
            s.call("idle_counts", 0.5)
        counts = {s.name: s.call("idle_counts", IDLE_S) for s in subs}
        counts["trainer"] = internals.idle_counts(t, IDLE_S)
    for who, got in counts.items():
        assert got["engine"] <= MAX_TURNS, f"{who}'s idle engine turned {got['engine']} times"
        # this process hosts the test's store: its server thread answers every member's store
        # calls (benchmarks/idle.py reports them); the others' native threads are NIXL's and UCX's
        busy = {
            n: c
            for n, c in got["threads"].items()
            if c > MAX_SWITCHES and not (who == "trainer" and n.startswith("native-"))
        }
        assert not busy, f"threads of idle {who} woke too often in {IDLE_S:g} s: {busy}"
