"""No frame stops a receiver: hostile agent names and frames from a raw NIXL agent.

The attacker is an outsider as it would act: it reads the victim's record from the store (no
secret in the namespace), loads the metadata into its own NIXL agent and sends notifications
under agent names of its choosing, then frames of every malformed kind. The assertions are about
the victim: an honest peer still finds it, its next honest put lands byte for byte, and its
next honest notification arrives.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import transport
from helpers import internals
from helpers.outsider import Outsider
from helpers.peer import Peer, pattern, sha
from helpers.polling import wait_until
from transport.peers.senders import HOLD_S
from transport.wire import (
    TAG_USER,
    decode_peer_record,
    frame_control,
    frame_user_notification,
)

pytestmark = pytest.mark.timeout(180)

N = 1 << 16
#: agent names a peer would never have: Unicode digits, a generation of 5,000 digits, zero,
#: a sign, a trailing newline, no name, no generation, control characters, a long name
HOSTILE_AGENTS = [
    "mallory#\u00b2",
    "mallory#\uff11",
    "mallory#" + "9" * 5000,
    "mallory#0",
    "mallory#-1",
    "mallory#+1",
    "mallory#1\n",
    "mallory\n#1",
    "#1",
    "mallory#",
    "mallory",
    "mal\x00lory#1",
    "m" * 4000 + "#1",
    "victim#1#1",
    "\u00e9ve#1",
]


def _frames(rng: random.Random) -> list[bytes]:
    """Malformed frames of every kind, and some random ones."""
    out = [
        b"",
        b"\x00",
        b"\xff" * 64,
        b"\x02",  # a control tag without a channel
        b"\x02\x7f" + b"ws/x",  # a channel longer than the frame
        b"\x02\x04\xff\xfe\xfd\xfc",  # a channel that is not ASCII
        frame_control("ws/policy", b"\xc1" * 64),  # a control message that is not msgpack
        frame_control("ws/policy", b"\x81\xa1k\xa5hello"),  # one of a publisher it is not
        bytes([TAG_USER]) + b"x" * ((64 << 10) + 1),  # over the payload limit
    ]
    out += [rng.randbytes(rng.randrange(1, 512)) for _ in range(40)]
    return out


def _an_honest_put_lands(friend: transport.Transport, victim: Peer, seed: int) -> None:
    """``friend``'s notified put reaches ``victim`` byte for byte, its notification is the one
    the victim reads, and nothing the attacker sent was delivered as a notification."""
    src = pattern(N, seed)
    note = b"honest-%d" % seed
    friend.put(src, "victim", "staging", notify=note).wait(30)
    peer, payload, shas = victim.call("notif_then_sha", 60.0, ["staging"])
    assert (peer, payload) == ("friend", note)
    assert shas["staging"] == sha(src)
    assert victim.call("notifications", 0.0) == []


def test_hostile_agent_names_and_frames_never_stop_the_receiver(tcp_store):
    ns = "hostile-ns"
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    regions = {"staging": ("uint8", N, "w")}
    with (
        Peer("victim", tcp_store.url, regions, namespace=ns) as victim,
        transport.Transport("friend", store=tcp_store, namespace=ns) as friend,
    ):
        rec = decode_peer_record(tcp_store.get(f"transport/{ns}/peers/victim"), None, ns)
        sent = 0
        for name in HOSTILE_AGENTS:
            try:
                out = Outsider(name)
            except Exception:  # NIXL refused to create an agent of that name: nothing to send
                continue
            try:
                agent = out.load(rec.metadata)
                frames = [f for f in [frame_user_notification(b"forged"), *_frames(rng)] if f]
                for frame in frames:
                    out.notify(agent, frame)
                sent += len(frames)
                # every frame from an agent that is no peer is refused, and counted, whatever
                # it holds: wait for all of them (the outsider's close would cancel the rest)
                wait_until(
                    lambda n=sent: victim.call("refused_notifications") >= n,
                    60,
                    f"the refusal of {sent} frames",
                )
            finally:
                out.close()
        assert sent > 100
        # the victim still works: found, written, notified
        friend.wait_for_peer("victim", timeout=30)
        _an_honest_put_lands(friend, victim, 11)


def test_with_a_secret_frames_under_a_live_peers_exact_agent_name_are_refused(tcp_store):
    """The real impersonation: the outsider takes the exact agent name of a live peer that the
    victim is connected to; with a secret, nothing it sends is delivered, and the real peer's
    next notification and put arrive."""
    ns = "exact-ns"
    secret = b"the-namespace-secret"
    regions = {"staging": ("uint8", N, "w")}
    with (
        Peer("victim", tcp_store.url, regions, namespace=ns, secret=secret) as victim,
        transport.Transport("friend", store=tcp_store, namespace=ns, secret=secret) as friend,
    ):
        friend.put(pattern(N, 1), "victim", "staging", notify=b"first").wait(30)
        assert victim.call("notification", 30.0) == ("friend", b"first")
        rec = decode_peer_record(tcp_store.get(f"transport/{ns}/peers/victim"), secret, ns)
        out = Outsider(f"friend#{friend.generation}")
        try:
            agent = out.load(rec.metadata)
            for frame in [frame_user_notification(b"forged"), *_frames(random.Random(5))]:
                if frame:
                    out.notify(agent, frame)
            wait_until(lambda: victim.call("refused_notifications") >= 40, 60, "refusals")
        finally:
            out.close()
        _an_honest_put_lands(friend, victim, 12)


def test_a_flood_of_raw_agents_costs_the_victim_bounded_store_reads_and_memory(tcp_store):
    """No secret. Raw agents the store has never heard of (``flood-k#1``) each send a burst of
    notifications: their frames wait (a store that restarted empty would show a live sender's
    record again within a heartbeat), the victim asks the store about each at most once a
    heartbeat interval until it gives up on it, and delivers nothing. An agent under a newer
    generation of a live peer's name is refused once the store shows that peer, and its next
    burst is refused on receipt, without asking the store again. Then an honest put lands."""
    agents, burst = 16, 40
    with (
        transport.Transport("victim", store=tcp_store.url) as victim,
        transport.Transport("friend", store=tcp_store) as friend,
    ):
        inbox = torch.zeros(N, dtype=torch.uint8)
        victim.expose("staging", inbox, access="w")
        reads = internals.count_record_reads(victim)
        rec = decode_peer_record(tcp_store.get("transport/default/peers/victim"))
        outsiders = [Outsider(f"flood-{k}#1") for k in range(agents)]
        outsiders.append(Outsider(f"friend#{friend.generation + 50}"))
        try:
            for out in outsiders:
                agent = out.load(rec.metadata)
                for _ in range(burst):
                    out.notify(agent, frame_user_notification(b"forged"))
            sent = burst * len(outsiders)
            wait_until(lambda: victim.refused_notifications >= sent, 60, f"{sent} refusals")
            asked = dict(reads)
            # once when each came, then at most once a heartbeat interval until given up on
            bound = 2 + int(HOLD_S / victim.heartbeat_interval)
            assert all(asked.get(f"flood-{k}", 0) <= bound for k in range(agents)), asked
            assert asked.get("friend") == 1, asked  # someone else at once: one read
            impostor = outsiders[-1]
            for _ in range(burst):
                impostor.notify(rec.agent, frame_user_notification(b"again"))
            wait_until(lambda: victim.refused_notifications >= sent + burst, 60, "refusals")
            assert reads.get("friend") == 1, dict(reads)  # refused on receipt: no store read
            assert list(victim.notifications(0.0)) == []
            assert internals.held_frames(victim) == 0
        finally:
            for out in outsiders:
                out.close()
        src = pattern(N, 21)
        friend.put(src, "victim", "staging", notify=b"honest").wait(30)
        n = victim.wait_notification(30)
        assert (n.peer, n.payload) == ("friend", b"honest") and sha(inbox) == sha(src)


def test_a_handler_that_raises_drops_its_frames_and_the_engine_goes_on(tcp_store):
    """The engine's last line: whatever the notification handler raises (a bug of ours on a
    peer's frames) drops those frames, is counted, and the next transfers work."""
    with (
        transport.Transport("a", store=tcp_store, namespace="raise-ns") as a,
        transport.Transport("b", store=tcp_store, namespace="raise-ns") as b,
    ):
        buf = torch.zeros(N, dtype=torch.uint8)
        b.expose("buf", buf)
        engine = b._engine  # noqa: SLF001 - the test reaches the engine it breaks
        real = engine._on_notifications  # noqa: SLF001
        calls = []

        def broken(notifs):
            calls.append(notifs)
            raise ValueError("a bug on a peer's frames")

        engine._on_notifications = broken  # noqa: SLF001
        a.notify("b", b"lost")
        wait_until(lambda: engine.handler_errors >= 1, 30, "the handler to fail")
        engine._on_notifications = real  # noqa: SLF001
        src = pattern(N, 3)
        a.put(src, "b", "buf", notify=b"kept").wait(30)
        n = b.wait_notification(30)
        assert (n.peer, n.payload) == ("a", b"kept")
        assert sha(buf) == sha(src)
        assert engine.error is None
