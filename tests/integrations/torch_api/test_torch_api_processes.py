"""torch's transport API on this library between real processes: pairing through a TCPStore,
a frozen peer, a killed peer, a close while writes are in flight, and one process talking to 8
peers on one agent. Every check is of the bytes that arrived (SHA-256 of the receiver's
buffer)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import torch

from helpers.peer import pattern, sha
from helpers.processes import free_port
from helpers.torch_api_peer import TorchApiPeer
from transport.backends import cma

pytestmark = [pytest.mark.torch_api, pytest.mark.slow]

MIB = 1 << 20


@pytest.fixture
def two() -> Iterator[tuple[TorchApiPeer, TorchApiPeer]]:
    """Two children, one endpoint each, connected to each other."""
    yield from _two()


@pytest.fixture
def two_over_nixl(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TorchApiPeer, TorchApiPeer]]:
    """The same, with every transfer through NIXL (no cross-memory attach): a write then needs
    its peer's agent, as across hosts."""
    monkeypatch.setenv(cma.CMA_ENV, "0")
    yield from _two()


def _two() -> Iterator[tuple[TorchApiPeer, TorchApiPeer]]:
    a = TorchApiPeer("a", nbytes=4 * MIB, wait=False)
    b = TorchApiPeer("b", nbytes=4 * MIB, wait=False)
    try:
        a.started()
        b.started()
        a.call("connect", 0, b.call("bind", 0))
        b.call("connect", 0, a.call("bind", 0))
        yield a, b
    finally:
        for child in (a, b):
            child.kill()


def test_two_processes_pair_through_a_tcpstore_and_move_64_mib() -> None:
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    a = TorchApiPeer("a", count=0, nbytes=64 * MIB, wait=False)
    b = TorchApiPeer("b", count=0, nbytes=64 * MIB, wait=False)
    try:
        a.started()
        b.started()
        a.begin("pair_rank", port, 3, 8)  # ranks need not be contiguous
        assert b.call("pair_rank", port, 8, 3, timeout=60) == 0
        assert a.end("pair_rank") == 0
        remote = b.call("describe", 0)
        sent = a.call("write", 0, remote, 5, 64 * MIB, 60.0, timeout=90)
        assert sent == sha(pattern(64 * MIB, 5))
        assert b.call("digest", 0) == sent
        # and back: a reads what b holds
        assert a.call("read", 0, b.call("describe", 0), 60.0, timeout=90) == sent
    finally:
        for child in (a, b):
            child.kill()
        del store


def test_a_frozen_peer_fails_the_write_with_timeout_error_and_it_is_withdrawn(
    two_over_nixl: tuple,
) -> None:
    a, b = two_over_nixl
    remote = b.call("describe", 0)
    b.signal(signal.SIGSTOP)
    try:
        result = a.call("write", 0, remote, 1, 4 * MIB, 2.0, timeout=60)
    finally:
        b.signal(signal.SIGCONT)
    assert result.startswith("TransferTimeout"), result
    # withdrawn: the endpoint goes on, and the next write lands whole
    sent = a.call("write", 0, remote, 2, 4 * MIB, 30.0, timeout=60)
    assert sent == sha(pattern(4 * MIB, 2))
    assert b.call("digest", 0) == sent


@pytest.mark.skipif(cma.refusal() is not None, reason=f"no cross-memory attach: {cma.refusal()}")
def test_a_frozen_peer_of_this_machine_takes_a_write_by_cross_memory_attach(two: tuple) -> None:
    a, b = two
    remote = b.call("describe", 0)
    b.signal(signal.SIGSTOP)
    try:  # one-sided: the kernel copies, nothing of the peer runs
        sent = a.call("write", 0, remote, 1, 4 * MIB, 10.0, timeout=60)
    finally:
        b.signal(signal.SIGCONT)
    assert sent == sha(pattern(4 * MIB, 1)) == b.call("digest", 0)


def test_a_killed_peer_fails_the_write_and_nothing_hangs(two: tuple) -> None:
    a, b = two
    remote = b.call("describe", 0)
    b.kill()
    result = a.call("write", 0, remote, 1, 4 * MIB, 10.0, timeout=60)
    assert result.split(":")[0] in ("PeerLostError", "TransferTimeout"), result
    assert a.call("close", 0, 10.0) == "closed"


def test_close_waits_for_the_writes_in_flight(two: tuple) -> None:
    a, b = two
    remote = b.call("describe", 0)
    sent = [a.call("write_async", 0, remote, 11, 30.0) for _ in range(3)]
    assert a.call("close", 0, 30.0, timeout=60) == "closed"
    assert b.call("digest", 0) == sent[-1] == sha(pattern(4 * MIB, 11))
    # the Works ended with their transfers: each succeeded
    assert a.call("finish", 0) == ["ok"] * 3


def test_one_process_talks_to_8_peers_on_one_agent() -> None:
    from torch.distributed._transport import new_transport

    from transport.integrations.torch_api import RemoteRegion

    children = [
        TorchApiPeer(f"p{k}", count=4, nbytes=MIB, wait=False, shared=False) for k in range(2)
    ]
    hub = [new_transport("transport", "cpu") for _ in range(8)]
    try:
        for child in children:
            child.started()
        peers = [(child, i) for child in children for i in range(4)]
        for endpoint, (child, i) in zip(hub, peers, strict=True):
            endpoint.connect(child.call("bind", i))
            child.call("connect", i, endpoint.bind())
        sources = [pattern(MIB, 100 + k) for k in range(8)]
        for k, (endpoint, (child, i)) in enumerate(zip(hub, peers, strict=True)):
            memory = endpoint.register_memory(sources[k])
            endpoint.write(memory.to_view(), RemoteRegion.deserialize(child.call("describe", i)))
        for k, (child, i) in enumerate(peers):
            assert child.call("digest", i) == sha(sources[k]), f"peer {k}"
        # one engine (one agent) on this side; 8 engines on theirs; bytes to each of the 8
        assert len({e.engine_name for e in hub}) == 1
        theirs = [name for child in children for name in child.call("engines")]
        assert len(set(theirs)) == 8
        traffic = hub[0].engine.traffic()
        assert sorted(traffic) == sorted(theirs)
        assert all(t.written >= MIB for t in traffic.values())
    finally:
        for endpoint in hub:
            endpoint.close()
        for child in children:
            child.kill()


def test_a_write_from_this_process_lands_in_a_child() -> None:
    """The test process is an endpoint too (a trainer in-process, a generator in a child)."""
    from torch.distributed._transport import new_transport

    from transport.integrations.torch_api import RemoteRegion

    b2 = TorchApiPeer("b2", nbytes=MIB)
    endpoint = new_transport("transport", "cpu", timeout=30.0)
    try:
        endpoint.connect(b2.call("bind", 0))
        b2.call("connect", 0, endpoint.bind())
        source = torch.arange(MIB // 4, dtype=torch.int32)
        memory = endpoint.register_memory(source)
        work = endpoint.write(
            memory.to_view(), RemoteRegion.deserialize(b2.call("describe", 0)), async_op=True
        )
        assert work.get_future().wait() == []
        assert b2.call("digest", 0) == sha(source)
    finally:
        endpoint.close()
        b2.kill()
