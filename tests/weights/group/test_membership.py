"""Weight-sync groups whose members come, go, die or freeze: a publisher killed mid-publish, and
subscribers that join late, leave, are killed or are stopped.

Every element of every tensor of version N holds N (see test_weight_sync)."""

from __future__ import annotations

import signal
import time

import pytest

import transport
from helpers import internals
from helpers.polling import wait_until
from helpers.ws_peer import MiB, WsPeerError, make_tensors, spec_of


def everywhere(names, value):
    return {n: (float(value), float(value)) for n in names}


def fill(tensors, value):
    for t in tensors.values():
        t.fill_(value)


def suspect(t, name):
    """Why ``t``'s peers() says ``name`` is suspect (None: it is not, or has no record)."""
    info = {i.name: i for i in t.peers()}.get(name)
    return None if info is None else info.suspect


def publish(pub, tensors, version, timeout=20.0):
    fill(tensors, version)
    return pub.publish(version, timeout=timeout).wait(timeout + 10)


def test_publisher_killed_mid_publish_leaves_the_previous_version(spawn):
    spec = spec_of(4, 16 * MiB)  # 4 tensors of 64 MiB: 256 MiB
    staging = spawn("sub", "gen-s", spec, mode="staging", wait=False)
    inplace = spawn("sub", "gen-i", spec, mode="inplace", wait=False)
    first = spawn("pub", "trainer", spec, wait=False)
    for child in (staging, inplace, first):
        child.started()
    status, _ = first.call("publish", 1, 1.0, 30.0, 60.0)
    assert status == {"gen-s": "done", "gen-i": "done"}
    for sub in (staging, inplace):
        assert sub.call("wait_for_version", 1, 30) == 1
    assert staging.call("apply") == 1

    # version 2's data goes, its notification is held back (so the kill cannot race the
    # transfer: 256 MiB over lanes can land between two RPCs)
    first.call("hold_notified_parts")
    first.call("publish_nowait", 2, 2.0, 30.0)
    for sub in (staging, inplace):  # version 2 has begun at both ...
        sub.call("wait_message", "begin", 2, 10)
    first.kill()  # ... and its publisher dies before announcing it complete
    assert first.proc.exitcode == -signal.SIGKILL

    for sub in (staging, inplace):
        assert sub.call("state")["version"] == 1, "version 2 completed before the kill"
        assert sub.call("state")["incomplete"] == 2
        with pytest.raises(WsPeerError, match="version 2 began but did not complete"):
            sub.call("wait_for_version", 2, 0.5)
    # the staging subscriber's live tensors and its newest slot still hold version 1
    assert staging.call("apply") == 1
    assert staging.call("live") == everywhere(spec, 1)
    slots = staging.call("staging")
    assert slots["slots"][slots["newest"]] == everywhere(spec, 1)
    assert staging.call("state") == {"version": 1, "applied": 1, "incomplete": 2}

    # the trainer restarts under the same name and publishes again
    second = spawn("pub", "trainer", spec)
    assert second.generation == first.generation + 1
    status, reasons = second.call("publish", 3, 3.0, 30.0, 60.0)
    assert status == {"gen-s": "done", "gen-i": "done"}, reasons
    for sub in (staging, inplace):
        assert sub.call("wait_for_version", 3, 30) == 3
        assert sub.call("apply") == 3
        assert sub.call("state") == {"version": 3, "applied": 3, "incomplete": None}
        assert sub.call("live") == everywhere(spec, 3)
        # version 2 never became complete anywhere
        seen = sub.call("wait_message", "ver", 3, 5)
        assert ("ver", 3) in [(k, v) for k, v, _ in seen]
        assert ("ver", 2) not in [(k, v) for k, v, _ in seen]
    assert staging.call("violations") == []


def test_a_subscriber_that_joins_late_gets_the_next_version_and_one_that_leaves_is_dropped(
    trainer, spawn
):
    spec = spec_of(3, 64 * 1024)
    early = spawn("sub", "gen-early", spec)
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors) as pub:
        assert publish(pub, tensors, 1).status == {"gen-early": "done"}
        late = spawn("sub", "gen-late", spec, mode="inplace")
        assert late.call("state")["version"] == -1
        r = publish(pub, tensors, 2)
        assert r.status == {"gen-early": "done", "gen-late": "done"}
        assert late.call("wait_for_version", 2, 10) == 2
        assert late.call("live") == everywhere(spec, 2)
        assert pub.subscribers() == ["gen-early", "gen-late"]

        late.call("close")  # leaves the group; its Transport stays up
        r = publish(pub, tensors, 3)
        assert r.status == {"gen-early": "done"}
        assert pub.subscribers() == ["gen-early"]
        assert late.call("state")["version"] == 2
        assert late.call("live") == everywhere(spec, 2)  # nothing more was written there

        late.stop()  # and the Transport too
        assert publish(pub, tensors, 4).status == {"gen-early": "done"}

        again = spawn("sub", "gen-late", spec)  # joins again, under the same name
        r = publish(pub, tensors, 5)
        assert r.status == {"gen-early": "done", "gen-late": "done"}, r.reasons
        assert again.call("wait_for_version", 5, 10) == 5
        assert again.call("apply") == 5
        assert again.call("live") == everywhere(spec, 5)
    assert early.call("wait_for_version", 5, 10) == 5
    assert early.call("apply") == 5
    assert early.call("live") == everywhere(spec, 5)


def two_subscribers(spawn, spec, first: str, second: str, mode: str):
    """Two subscriber children started together: ``first`` in staging mode, ``second`` in
    ``mode``."""
    a = spawn("sub", first, spec, wait=False)
    b = spawn("sub", second, spec, mode=mode, wait=False)
    a.started()
    b.started()
    return a, b


@pytest.mark.parametrize("mode", ["staging", "inplace"])
def test_a_killed_subscriber_is_lost_once_then_absent(trainer, spawn, mode):
    spec = spec_of(2, 1024 * 1024)  # 8 MiB
    alive, victim = two_subscribers(spawn, spec, "gen-alive", "gen-victim", mode)
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors) as pub:
        assert publish(pub, tensors, 1).status == {"gen-alive": "done", "gen-victim": "done"}
        victim.kill()
        r = publish(pub, tensors, 2)
        assert r.status == {"gen-alive": "done", "gen-victim": "lost"}, r.reasons
        assert "gen-victim" in r.reasons
        for v in (3, 4):
            r = publish(pub, tensors, v)
            assert r.status == {"gen-alive": "done"}, r.reasons
        assert pub.subscribers() == ["gen-alive"]
    assert alive.call("wait_for_version", 4, 10) == 4
    assert alive.call("apply") == 4
    assert alive.call("live") == everywhere(spec, 4)


@pytest.mark.parametrize("mode", ["staging", "inplace"])
def test_a_stopped_subscriber_is_excluded_at_the_deadline_without_delaying_others(
    tcp_store, spawn, mode
):
    """The deadline's path: a trainer that beats (and judges heartbeats) every 4 s finds the
    stopped one suspect only after 12 s (liveness.py), past the 8 s deadline; the next test
    shows the suspect's path."""
    spec = spec_of(2, 2 * MiB)  # 16 MiB: more than socket buffers hold
    other, frozen = two_subscribers(spawn, spec, "gen-other", "gen-frozen", mode)
    tensors = make_tensors(spec)
    with (
        transport.Transport("trainer", store=tcp_store, timeout=30, heartbeat_interval=4.0) as t,
        transport.WeightPublisher(t, tensors) as pub,
    ):
        assert publish(pub, tensors, 1).status == {"gen-other": "done", "gen-frozen": "done"}
        assert frozen.call("wait_for_version", 1, 10) == 1
        frozen.signal(signal.SIGSTOP)
        try:
            fill(tensors, 2)
            start = time.monotonic()
            h = pub.publish(2, timeout=8.0)
            # the other subscriber has version 2 while the frozen one is still stopped, well
            # before the deadline (a publisher waiting on the frozen one would reach it only then)
            assert other.call("wait_for_version", 2, 6.0) == 2
            r = h.wait(30)
            elapsed = time.monotonic() - start
        finally:
            frozen.signal(signal.SIGCONT)
        assert r.status == {"gen-other": "done", "gen-frozen": "excluded"}, r.reasons
        assert "gen-frozen" in r.reasons
        assert elapsed >= 8.0, elapsed  # excluded at the deadline, not before
        assert other.call("apply") == 2
        assert other.call("live") == everywhere(spec, 2)

        # stopped longer than the suspect bar, it is served again once it has beaten again
        wait_until(lambda: not suspect(t, "gen-frozen"), 30, "gen-frozen beating again")
        r = publish(pub, tensors, 3)
        assert r.status == {"gen-other": "done", "gen-frozen": "done"}, r.reasons
    assert frozen.call("wait_for_version", 3, 10) == 3
    assert frozen.call("apply") == 3
    assert frozen.call("live") == everywhere(spec, 3)
    assert frozen.call("violations") == []


@pytest.mark.parametrize("mode", ["staging", "inplace"])
def test_a_suspect_subscriber_is_excluded_at_once_and_served_again_once_it_beats(
    trainer, spawn, mode
):
    """A subscriber stopped while idle is found by its heartbeat, not by a transfer's deadline:
    once peers() reports it suspect, a publish excludes it at once with that reason (the
    deadline is minutes away); running again, it beats and the next publish serves it."""
    spec = spec_of(2, MiB)
    other, frozen = two_subscribers(spawn, spec, "gen-other", "gen-frozen", mode)
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors) as pub:
        assert publish(pub, tensors, 1).status == {"gen-other": "done", "gen-frozen": "done"}
        assert frozen.call("wait_for_version", 1, 10) == 1
        frozen.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: suspect(trainer, "gen-frozen"), 60, "gen-frozen suspect")
            fill(tensors, 2)
            h = pub.publish(2, timeout=300.0)
            # settled by publish() itself, before any transfer to it was posted
            assert h.result.status.get("gen-frozen") == "excluded", h.result.reasons
            r = h.wait(60)
            assert other.call("wait_for_version", 2, 10) == 2
        finally:
            frozen.signal(signal.SIGCONT)
        assert r.status == {"gen-other": "done", "gen-frozen": "excluded"}, r.reasons
        why = r.reasons["gen-frozen"]
        assert why.startswith("suspect:") and "heartbeat" in why, why
        assert other.call("apply") == 2
        assert other.call("live") == everywhere(spec, 2)
        assert frozen.call("state")["version"] == 1  # nothing of version 2 was sent to it

        wait_until(lambda: not suspect(trainer, "gen-frozen"), 30, "gen-frozen beating again")
        r = publish(pub, tensors, 3)
        assert r.status == {"gen-other": "done", "gen-frozen": "done"}, r.reasons
    for sub in (other, frozen):
        assert sub.call("wait_for_version", 3, 10) == 3
        assert sub.call("apply") == 3
        assert sub.call("live") == everywhere(spec, 3)
        assert sub.call("violations") == []


@pytest.mark.parametrize("mode", ["staging", "inplace"])
def test_a_subscriber_frozen_during_a_publish_is_excluded_as_suspect_long_before_the_deadline(
    tcp_store, spawn, mode
):
    """Stopped just before a publish whose deadline is two minutes away, its write stays in
    flight; while the publish waits for it the publisher reads its heartbeat, and once that is
    stale it excludes it as suspect: the publish completes for the other subscriber long before
    the deadline. Running again, it beats and the next publish serves it."""
    beat = 0.2  # every peer of the namespace beats as often (liveness.py's rule)
    spec = spec_of(2, 2 * MiB)  # 16 MiB: more than socket buffers hold
    other = spawn("sub", "gen-other", spec, wait=False, heartbeat_interval=beat)
    frozen = spawn("sub", "gen-frozen", spec, mode=mode, wait=False, heartbeat_interval=beat)
    other.started()
    frozen.started()
    tensors = make_tensors(spec)
    with (
        transport.Transport("trainer", store=tcp_store, timeout=30, heartbeat_interval=beat) as t,
        transport.WeightPublisher(t, tensors) as pub,
    ):
        assert publish(pub, tensors, 1).status == {"gen-other": "done", "gen-frozen": "done"}
        assert frozen.call("wait_for_version", 1, 10) == 1
        frozen.signal(signal.SIGSTOP)
        try:
            fill(tensors, 2)
            h = pub.publish(2, timeout=120.0)
            assert other.call("wait_for_version", 2, 30) == 2
            r = h.wait(60)  # half the deadline: only a suspect frozen one lets it end by then
        finally:
            frozen.signal(signal.SIGCONT)
        assert r.status == {"gen-other": "done", "gen-frozen": "excluded"}, r.reasons
        why = r.reasons["gen-frozen"]
        assert why.startswith("suspect:") and "heartbeat" in why, why
        assert other.call("apply") == 2
        assert other.call("live") == everywhere(spec, 2)

        wait_until(lambda: not suspect(t, "gen-frozen"), 30, "gen-frozen beating again")
        r = publish(pub, tensors, 3)
        assert r.status == {"gen-other": "done", "gen-frozen": "done"}, r.reasons
    for sub in (other, frozen):
        assert sub.call("wait_for_version", 3, 10) == 3
        assert sub.call("apply") == 3
        assert sub.call("live") == everywhere(spec, 3)
        assert sub.call("violations") == []


def test_a_version_given_up_by_its_publisher_is_never_completed_late(tcp_store, trainer):
    """The race an ``abort`` closes: a publisher gives a write up at its deadline (withdrawn, the
    subscriber excluded) but the write's ``ver`` was already on its way. The subscriber must not
    complete that version once told it was given up, since the publisher may hand the slot out
    again on the subscriber's next credit. Messages are fed to a real subscriber in the order the
    race delivers them; the bytes of the slot are the subscriber's own."""
    from transport.weights.group.messages import Abort, Begin, Ver, encode

    spec = spec_of(2, 1024)
    with transport.Transport("gen-0", store=tcp_store, timeout=10) as t:
        sub = transport.WeightSubscriber(t, make_tensors(spec), group="policy", mode="staging")
        on_message = internals.control_handler(sub)  # the subscriber's handler of control messages
        try:
            on_message("trainer", encode(Begin(5, 1)))
            on_message("trainer", encode(Abort(5, 1)))
            on_message("trainer", encode(Ver(5, 1)))  # late: ignored
            with pytest.raises(transport.TransferTimeout, match="did not arrive"):
                sub.wait_for_version(5, timeout=0.2)
            assert sub.version == -1 and internals.newest_slot(sub) is None
            # the next version written into the same slot completes as usual
            on_message("trainer", encode(Begin(6, 1)))
            on_message("trainer", encode(Ver(6, 1)))
            assert sub.wait_for_version(6, timeout=5) == 6 and internals.newest_slot(sub) == 1
            # an abort of a version that already completed changes nothing
            on_message("trainer", encode(Abort(6, 1)))
            on_message("trainer", encode(Begin(7, 0)))
            on_message("trainer", encode(Ver(7, 0)))
            assert sub.wait_for_version(7, timeout=5) == 7 and internals.newest_slot(sub) == 0
        finally:
            sub.close()
