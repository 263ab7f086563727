"""A store writer without the secret writes the largest record the limits allow under a live
peer's own key (valid: the peer's own agent and metadata, every region inside one registration),
two variants in turn so that no cache holds it. The victim puts its own record back at each
round without building the forgery (it reads only its generation), its heartbeat comes from a
thread that decodes nothing, and an honest put into it lands. (When the victim decoded what it
found under its key, six rounds of the largest record the old limits allowed raised its peak
memory by about a GiB.)"""

from __future__ import annotations

import time

import pytest

import transport
from helpers.peer import Peer, pattern, sha
from helpers.polling import wait_until
from transport import RegionInfo, store_from_url
from transport.memory.region_codec import MAX_REGIONS, MAX_TOTAL_DIMS
from transport.security import signed
from transport.wire import PeerRecord, decode_heartbeat, decode_peer_record, encode_peer_record

pytestmark = pytest.mark.timeout(300)

ROUNDS = 6
MiB = 1 << 20


def _bomb(own: PeerRecord, variant: int) -> bytes:
    """The largest record the budget allows, of ``own``'s agent and metadata."""
    dims = (1,) * (MAX_TOTAL_DIMS // MAX_REGIONS)
    addr = own.registrations[0][0]
    regions = tuple(
        RegionInfo(f"v{variant}.layers.{i}.mlp.experts.w", addr, 1, "uint8", dims, "rw", "cpu")
        for i in range(MAX_REGIONS)
    )
    forged = PeerRecord(
        name=own.name,
        namespace=own.namespace,
        generation=own.generation,
        agent=own.agent,
        backend=own.backend,
        metadata=own.metadata,
        host=own.host,
        pid=own.pid,
        version=own.version,
        created=own.created,
        regions=regions,
        registrations=own.registrations[:1],
        revision=own.revision + 1 + variant,
    )
    return encode_peer_record(forged)


def _heartbeat_age(raw_store, key: str) -> float:
    value = signed.decode(None, key, raw_store.try_get(key), "a heartbeat")
    return time.time() - decode_heartbeat(value.body)[1]


def test_the_largest_valid_record_under_a_peers_own_key_costs_it_nothing(tcp_store) -> None:
    raw = store_from_url(tcp_store.url)
    victim = Peer("victim", tcp_store.url, {"buf": ("uint8", MiB, "w")})
    try:
        key, hb = "transport/default/peers/victim", "transport/default/hb/victim"
        own = raw.try_get(key)
        assert own is not None
        bombs = [_bomb(decode_peer_record(own), v) for v in range(2)]
        before = victim.call("max_rss_mib")
        ages = []
        for i in range(ROUNDS):
            bomb = bombs[i % 2]
            raw.set(key, bomb)
            # the victim writes its own record back over it (it sees a record it did not write)
            wait_until(lambda b=bomb: raw.try_get(key) not in (b, None), 30, "its record back")
            assert raw.try_get(key) == own
            ages.append(_heartbeat_age(raw, hb))
        grew = victim.call("max_rss_mib") - before
        print(
            f"\nvictim's peak memory grew {grew:.1f} MiB over {ROUNDS} records of "
            f"{len(bombs[0])} bytes; its heartbeat at most {max(ages):.2f} s old"
        )
        assert grew < 64, grew  # the forgery's memory map was never built
        with transport.Transport("writer", store=tcp_store.url) as w:
            w.put(pattern(MiB, 5), "victim", "buf").wait(30)
            assert victim.call("sha", "buf") == sha(pattern(MiB, 5))
            (info,) = [p for p in w.peers() if p.name == "victim"]
            assert info.suspect is None, info.suspect
    finally:
        victim.stop()
        raw.close()
