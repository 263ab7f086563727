"""An outsider against a namespace: a process that can read the store and runs its own NIXL agent.

With a ``secret``, what the store holds gives it nothing to connect with (records are sealed), and
a frame it gets to a peer anyway (had it learned the metadata some other way) is refused: it
carries no valid MAC, or is a replay. Without a secret the outsider is as trusted as any peer
(the README says so; the first test shows it), but it still cannot pass itself off as a peer
whose agent it is not. Victims are real peers in child processes; bytes are checked by hash.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

import transport
from helpers.outsider import Outsider
from helpers.peer import Peer, sha
from helpers.polling import wait_until
from transport import SignatureError, TransportError
from transport.security import signed
from transport.security.sealing import keys_for
from transport.wire import agent_name, decode_peer_record, frame_user_notification

SECRET = b"the-namespace-secret"
N = 4096  # bytes per region


def _victim(store, ns: str, secret: bytes | None) -> Peer:
    regions = {"weights": ("uint8", N, "r"), "staging": ("uint8", N, "w")}
    kwargs = {"namespace": ns} | ({"secret": secret} if secret else {})
    return Peer("victim", store.url, regions, **kwargs)


def _everything_an_attacker_can_try(raw: bytes) -> list[bytes]:
    """Every byte string in a stored record that could be connection metadata: the envelope's
    fields, the body's fields if the body parses, and the whole value."""
    out = [raw]
    try:
        env = msgpack.unpackb(raw)
    except Exception:
        return out
    for v in env.values() if isinstance(env, dict) else []:
        if isinstance(v, bytes):
            out.append(v)
            try:
                body = msgpack.unpackb(v)
            except Exception:
                continue
            if isinstance(body, dict):
                out += [b for b in body.values() if isinstance(b, bytes)]
    return out


def test_without_a_secret_whoever_reads_the_store_can_write_read_only_memory(any_store):
    """The threat a secret answers, shown: the plain record is all an outsider needs."""
    with _victim(any_store, "open-ns", None) as victim:
        before = victim.call("fill", "weights", 7)
        raw = any_store.get("transport/open-ns/peers/victim")
        rec = decode_peer_record(raw, None, "open-ns")
        out = Outsider("mallory#1")
        try:
            agent = out.load(rec.metadata)
            region = rec.region_map()["weights"]  # exposed access="r"
            out.write(agent, region.addr, bytes(N))
        finally:
            out.close()
        assert victim.call("sha", "weights") == sha(torch.zeros(N, dtype=torch.uint8)) != before


def test_with_a_secret_the_store_gives_an_outsider_nothing_to_connect_with(any_store):
    with _victim(any_store, "closed-ns", SECRET) as victim:
        weights = victim.call("fill", "weights", 7)
        staging = victim.call("fill", "staging", 8)
        raw = any_store.get("transport/closed-ns/peers/victim")
        with pytest.raises(SignatureError, match="sealed"):
            decode_peer_record(raw, None, "closed-ns")
        # nothing in the stored bytes names the agent or loads as its metadata
        assert agent_name("victim", victim.generation).encode() not in raw
        out = Outsider("mallory#1")
        try:
            loaded = []
            for candidate in _everything_an_attacker_can_try(raw):
                try:
                    loaded.append(out.load(candidate))
                except TransportError:
                    pass
            assert loaded == []
        finally:
            out.close()
        # and a Transport without the secret is refused before a byte moves, for writes and reads
        with transport.Transport("mallory", store=any_store, namespace="closed-ns") as t:
            with pytest.raises(SignatureError, match="this Transport has none"):
                t.put(torch.zeros(N, dtype=torch.uint8), "victim", "weights")
            with pytest.raises(SignatureError, match="this Transport has none"):
                t.get(torch.zeros(N, dtype=torch.uint8), "victim", "staging")
        assert victim.call("shas", ["weights", "staging"]) == {
            "weights": weights,
            "staging": staging,
        }


def _leaked_agent(store, ns: str, name: str) -> tuple[str, bytes]:
    """The victim's agent and metadata, as if they had leaked (the test holds the secret)."""
    rec = decode_peer_record(store.get(f"transport/{ns}/peers/{name}"), SECRET, ns)
    return rec.agent, rec.metadata


def test_with_a_secret_a_frame_without_a_valid_mac_is_refused(any_store):
    ns = "mac-ns"
    with (
        _victim(any_store, ns, SECRET) as victim,
        Peer("friend", any_store.url, {}, namespace=ns, secret=SECRET) as friend,
    ):
        agent, md = _leaked_agent(any_store, ns, "victim")
        # the outsider takes the friend's exact agent name
        out = Outsider(agent_name("friend", friend.generation))
        try:
            assert out.load(md) == agent
            frame = frame_user_notification(b"forged")
            out.notify(agent, frame)  # no MAC at all
            out.notify(agent, frame + os.urandom(24))  # a made-up sequence number and MAC
            wrong = keys_for(b"another-secret", ns).sealer(
                agent_name("friend", friend.generation), agent
            )
            out.notify(agent, wrong.seal(frame))  # a MAC under another secret
            wait_until(lambda: victim.call("refused_notifications") >= 3, 30, "3 refusals")
        finally:
            out.close()
        friend.call("notify", "victim", b"real")
        assert victim.call("notification", 30.0) == ("friend", b"real")
        assert victim.call("notifications", 0.0) == []
        assert victim.call("refused_notifications") == 3


def test_with_a_secret_a_replayed_frame_is_refused(any_store):
    ns = "replay-ns"
    with _victim(any_store, ns, SECRET) as victim:
        agent, md = _leaked_agent(any_store, ns, "victim")
        sender = agent_name("friend", 3)
        # a frame a holder of the secret sent once, captured on the way
        sealed = keys_for(SECRET, ns).sealer(sender, agent).seal(frame_user_notification(b"once"))
        out = Outsider(sender)
        try:
            out.load(md)
            out.notify(agent, sealed)
            assert victim.call("notification", 30.0) == ("friend", b"once")
            out.notify(agent, sealed)
            out.notify(agent, sealed)
            wait_until(lambda: victim.call("refused_notifications") >= 2, 30, "2 refusals")
        finally:
            out.close()
        assert victim.call("notifications", 0.0) == []


def test_without_a_secret_a_notification_names_the_agent_it_came_from(any_store):
    ns = "names-ns"
    with (
        _victim(any_store, ns, None) as victim,
        transport.Transport("gen-0", store=any_store, namespace=ns) as gen0,
    ):
        rec = decode_peer_record(any_store.get(f"transport/{ns}/peers/victim"), None, ns)
        frame = frame_user_notification(b"forged")
        # an agent that names itself as another incarnation of gen-0, and one of nobody
        outs = [Outsider(agent_name("gen-0", gen0.generation + 1000)), Outsider("ghost#1")]
        try:
            for out in outs:
                out.load(rec.metadata)
                out.notify(rec.agent, frame)
            wait_until(lambda: victim.call("refused_notifications") >= 2, 30, "2 refusals")
        finally:
            for out in outs:
                out.close()
        gen0.notify("victim", b"real")  # the real gen-0, never connected to by the victim
        assert victim.call("notification", 30.0) == ("gen-0", b"real")
        assert victim.call("notifications", 0.0) == []
        assert victim.call("refused_notifications") == 2


def test_without_a_secret_an_agent_named_exactly_like_a_live_peer_is_taken_for_it(any_store):
    """The real impersonation, without a secret: an agent that takes the exact name of a live
    peer's agent (``gen-0#<generation>``) is taken for that peer, since nothing but the name it
    gives itself says who sent a notification. This is the limit the README states for a
    namespace without a secret; with one, the same attack is refused
    (test_hostile_frames.py::test_with_a_secret_frames_under_a_live_peers_exact_agent_name_are_refused)."""
    ns = "exact-open-ns"
    with (
        _victim(any_store, ns, None) as victim,
        transport.Transport("gen-0", store=any_store, namespace=ns) as gen0,
    ):
        gen0.notify("victim", b"real")
        assert victim.call("notification", 30.0) == ("gen-0", b"real")
        rec = decode_peer_record(any_store.get(f"transport/{ns}/peers/victim"), None, ns)
        out = Outsider(agent_name("gen-0", gen0.generation))
        try:
            out.load(rec.metadata)
            out.notify(rec.agent, frame_user_notification(b"forged"))
            assert victim.call("notification", 30.0) == ("gen-0", b"forged")
        finally:
            out.close()


def test_without_a_secret_a_forged_left_mark_changes_nothing_while_its_peer_beats(any_store):
    """A store writer marks a live peer as having left (``left/<name>`` with its generation,
    as the peer itself writes it when it closes): while the peer's heartbeat of that
    incarnation is in the store nobody takes it for closed; a put and a notification still
    reach it. (Deleting its heartbeat too makes it look closed until its next beat: the denial
    the README lists.)"""
    ns = "left-ns"
    with (
        _victim(any_store, ns, None) as victim,
        transport.Transport("writer", store=any_store, namespace=ns) as w,
    ):
        key = f"transport/{ns}/left/victim"
        any_store.set(key, signed.encode(None, key, "victim", victim.generation, b""))
        assert w.core.suspect("victim", victim.generation) is None
        src = torch.arange(N, dtype=torch.int32).to(torch.uint8)
        w.put(src, "victim", "staging", notify=b"after the mark").wait(30)
        assert victim.call("notification", 30.0) == ("writer", b"after the mark")
        assert victim.call("sha", "staging") == sha(src)
        (info,) = [p for p in w.peers() if p.name == "victim"]
        assert info.suspect is None
