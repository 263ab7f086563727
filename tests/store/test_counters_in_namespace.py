"""Garbage in a namespace's counters (a peer's generation counter, the membership count, the
dump requests), on the embedded store and on Redis: it never stops a Transport from starting,
``peers()``, a put or a dump, each repair keeps what the counter promises (a restarted peer's
generation is above every earlier one; no member drops out of the index), and a warning names
the key."""

from __future__ import annotations

import logging

import pytest
import torch

import transport
from helpers.peer import Peer, pattern, sha
from helpers.polling import wait_until
from transport.store.base import parse_integer
from transport.wire import decode_peer_record

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10
NS = "transport/default/"
# not a number, empty, negative, over 2**63, and (for TCPStore, which parses a leading number)
# a smaller number followed by garbage
NOT_A_COUNTER = [b"not a number", b"", b"-5", b"99999999999999999999999"]


def _counter(store, key: str) -> int | None:
    raw = store.try_get(key)
    return None if raw is None else parse_integer(raw)


@pytest.mark.parametrize("garbage", [*NOT_A_COUNTER, b"12abc"])
def test_a_restarted_peer_gets_a_newer_generation_over_a_garbage_counter(
    any_store, garbage, caplog
):
    key = NS + "gen/recv"
    any_store.add(key, 20)  # the old incarnation is generation 21: above what "12abc" parses to
    old = Peer("recv", any_store.url, {"buf": ("uint8", 64 * KiB, "w")})
    writer = Peer("writer", any_store.url)
    try:
        assert old.generation == 21
        assert writer.call("put_pattern", "recv", "buf", 64 * KiB, 1, 30) == old.call("sha", "buf")
        old.kill()  # its record (generation 21) stays in the store
        any_store.set(key, garbage)
        buf = torch.zeros(64 * KiB, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING, "transport"):
            new = transport.Transport("recv", store=any_store, timeout=30)
        try:
            new.expose("buf", buf, access="w")
            assert new.generation > old.generation
            assert key in caplog.text and "repairing" in caplog.text
            assert _counter(any_store, key) == new.generation
            # the writer, which knew the old incarnation, reaches the new one
            assert writer.call("put_pattern", "recv", "buf", 64 * KiB, 2, 30) == sha(buf)
            assert sha(buf) == sha(pattern(64 * KiB, 2))
        finally:
            new.close()
    finally:
        old.kill()
        writer.stop()


@pytest.mark.parametrize("garbage", NOT_A_COUNTER)
def test_a_garbage_member_count_stops_neither_peers_nor_a_new_transport(any_store, garbage, caplog):
    key = NS + "members/count"
    with (
        Peer("recv", any_store.url, {"buf": ("uint8", 64 * KiB, "w")}) as recv,
        transport.Transport("writer", store=any_store, timeout=30) as w,
    ):
        any_store.set(key, garbage)
        with caplog.at_level(logging.WARNING, "transport"):
            assert {p.name for p in w.peers()} == {"recv", "writer"}
        assert key in caplog.text and "repairing" in caplog.text
        any_store.set(key, garbage)
        with Peer("late", any_store.url) as late:  # joins over the garbage
            # the late joiner took an index above every member's: nobody dropped out
            assert {p.name for p in w.peers()} == {"recv", "writer", "late"}
            assert late.call("put_pattern", "recv", "buf", 64 * KiB, 3, 30) == recv.call(
                "sha", "buf"
            )
            src = pattern(64 * KiB, 4)
            w.put(src, "recv", "buf").wait(30)
            assert recv.call("sha", "buf") == sha(src)


def test_an_owner_restores_its_record_over_garbage_counters(any_store):
    """The store lost a live peer's record and membership entry (a Redis restarted empty) and
    holds garbage in its generation counter and the member count: the owner puts back its
    record, sets its counter to its own generation (so nobody takes it for restarted) and joins
    the index again."""
    with (
        Peer(
            "recv", any_store.url, {"buf": ("uint8", 64 * KiB, "w")}, heartbeat_interval=0.05
        ) as recv,
        transport.Transport("writer", store=any_store, timeout=30) as w,
    ):
        w.put(pattern(64 * KiB, 1), "recv", "buf").wait(30)
        gen_key = NS + "gen/recv"
        any_store.set(gen_key, b"\xc1garbage")
        any_store.set(NS + "members/count", b"")
        any_store.delete(NS + "members/by-name/recv")
        any_store.delete(NS + "peers/recv")

        def restored() -> bool:
            raw = any_store.try_get(NS + "peers/recv")
            return raw is not None and decode_peer_record(raw).generation == recv.generation

        wait_until(restored, 30, "the owner writing its record back")
        wait_until(lambda: _counter(any_store, gen_key) is not None, 30, "the counter repaired")
        assert _counter(any_store, gen_key) == recv.generation
        assert {p.name for p in w.peers()} == {"recv", "writer"}
        src = pattern(64 * KiB, 2)
        w.put(src, "recv", "buf").wait(30)
        assert recv.call("sha", "buf") == sha(src)


def test_garbage_in_the_dump_requests_stops_no_transport_and_requests_still_reach_peers(
    any_store, tmp_path
):
    d = tmp_path / "trace"
    any_store.set(NS + "trace/requests", b"not a number")
    other = Peer("other", any_store.url, {"buf": ("uint8", 4 * KiB, "w")}, trace_dir=str(d))
    victim = Peer("victim", any_store.url, {"buf": ("uint8", 4 * KiB, "w")})
    try:
        with transport.Transport("writer", store=any_store, trace_dir=d, timeout=30) as w:
            w.put(pattern(4 * KiB, 1), "victim", "buf").wait(30)
            victim.kill()
            with pytest.raises(transport.TransportError):
                w.put(pattern(4 * KiB, 2), "victim", "buf").wait(30)
            # the writer repairs the counter as it asks; "other" answers the request
            wait_until(
                lambda: {f.name.split(".")[1] for f in d.glob("*.jsonl")} >= {"writer", "other"},
                30,
                "dumps of the writer and of the peer it asked",
            )
    finally:
        victim.kill()
        other.stop()
