"""A store writer without the secret raises a peer's generation counter: with a secret, that
must not silence the peer. The counter is only a hint; a connection is dropped only once the
peer's sealed record names a newer incarnation, and a connection made again to the same
incarnation continues the sequence numbers its receiver expects."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.polling import wait_until
from helpers.ws_peer import SubscriberProcess, publish_served
from transport import store_from_url
from transport.peers.directory import Directory

pytestmark = pytest.mark.timeout(240)

SECRET = b"the-namespace-secret"
N = 1 << 18


def _heartbeats_after(t: transport.Transport, n: int) -> None:
    """Wait until ``t``'s housekeeping has written ``n`` more heartbeats: each round that
    writes one then checks its connections against the store (drop_restarted)."""
    beats = Directory(t.store, t.namespace, SECRET)
    seen = [beats.last_heartbeat(t.name)]
    for _ in range(n):
        wait_until(lambda: beats.last_heartbeat(t.name) != seen[-1], 30, "a housekeeping round")
        seen.append(beats.last_heartbeat(t.name))


@pytest.mark.parametrize("store_kind", ["tcp", "redis"])
def test_a_forged_generation_counter_silences_nobody(store_kind, tcp_store, request):
    url = tcp_store.url if store_kind == "tcp" else request.getfixturevalue("redis_url")
    spec = {"w": ((N,), "float32")}
    ns = f"forged-gen-{store_kind}"
    subs = [
        SubscriberProcess(name, url, spec, namespace=ns, secret=SECRET)
        for name in ("gen-0", "gen-1")
    ]
    outsider = store_from_url(url)
    try:
        with transport.Transport(
            "trainer", store=url, namespace=ns, secret=SECRET, heartbeat_interval=0.2
        ) as t:
            tensors = {"w": torch.zeros(N)}
            pub = transport.WeightPublisher(t, tensors)
            publish_served(pub, tensors, 1, subs)
            before = internals.connection(t, "gen-1")
            # the outsider (no secret, only the store) raises gen-1's counter by 5
            outsider.add(f"transport/{ns}/gen/gen-1", 5)
            _heartbeats_after(t, 2)
            assert internals.connection(t, "gen-1") is before  # not dropped for a hint
            for version in range(2, 8):
                publish_served(pub, tensors, version, subs)
            # a reconnect to the same incarnation (as after a transient loss) changes nothing
            internals.drop_connection(t, before)
            for version in range(8, 12):
                publish_served(pub, tensors, version, subs)
            pub.close()
    finally:
        outsider.close()
        for s in subs:
            s.stop()
