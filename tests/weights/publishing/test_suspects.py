"""A subscriber that becomes suspect while a publish waits for it is excluded at once, with that
reason, and the publish completes for the others long before its deadline: for a plain
publisher and for a sharded trainer's rank, on the loopback backend (the generator's transfers
held as a stopped process holds them; its heartbeat verdict given by the test, which
tests/weights/group/test_membership.py reads from a real stopped process)."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers.loopback_net import frozen, pattern
from transport.weights import ShardedPublisher, SourceLayout
from transport.weights.publishing.roster import Roster

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

N = 4096


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_a_subscriber_suspect_during_a_publish_is_excluded_before_the_deadline(
    loopback_net, monkeypatch, kind
):
    stopped: set[str] = set()
    suspects = Roster.suspects

    def heartbeats(self, members):
        members = list(members)
        out = suspects(self, members)
        out.update(
            {
                m.name: "its last heartbeat is 9.9 s old (the test's)"
                for m in members
                if m.name in stopped
            }
        )
        return out

    monkeypatch.setattr(Roster, "suspects", heartbeats)
    trainer = loopback_net.make("trainer", heartbeat_interval=0.1)
    weights = {"w": pattern(N, 1)}
    if kind == "plain":
        pub = transport.WeightPublisher(trainer, weights, group="policy")
    else:
        layout = SourceLayout.split(1, {"w": ((N,), torch.uint8)})
        pub = ShardedPublisher(trainer, weights, layout, 0, group="policy")
    subs = {}
    for role in ("gen-a", "gen-b"):
        t = loopback_net.make(role, heartbeat_interval=0.1)
        live = {"w": torch.zeros(N, dtype=torch.uint8)}
        subs[t.name] = (transport.WeightSubscriber(t, live, group="policy"), live)
    a, b = sorted(subs)
    assert pub.publish(1, timeout=10).wait(10).done == [a, b]
    weights["w"].copy_(pattern(N, 2))
    with frozen(subs[b][0].transport):
        handle = pub.publish(2, timeout=120)
        subs[a][0].wait_for_version(2, timeout=10)
        assert not handle.done()  # it waits for the frozen one
        stopped.add(b)
        result = handle.wait(30)  # long before the deadline
    assert result.done == [a] and result.excluded == [b], result
    assert result.reasons[b].startswith("suspect: its last heartbeat is 9.9 s old"), result
    stopped.clear()
    weights["w"].copy_(pattern(N, 3))
    assert pub.publish(3, timeout=10).wait(20).done == [a, b]
    for sub, live in subs.values():
        sub.wait_for_version(3, timeout=10)
        assert sub.apply() == 3 and torch.equal(live["w"], pattern(N, 3))
    pub.close()
