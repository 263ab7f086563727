"""torch's transport API on this library, in one process: every documented call, checked by the
bytes that arrived. ``pair(shared=False)`` gives each endpoint an engine of its own, so the
transfers go through two NIXL agents; ``pair(shared=True)`` puts both on one engine (one agent),
where they copy directly."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.torch_api


def _pair(shared: bool, **options: object) -> tuple[object, object]:
    from torch.distributed._transport import new_transport

    first = new_transport("transport", "cpu", shared=shared, **options)
    second = new_transport("transport", "cpu", shared=shared, **options)
    first.connect(second.bind())
    second.connect(first.bind())
    return first, second


@pytest.fixture(params=[False, True], ids=["two-engines", "one-engine"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[object, object]]:
    first, second = _pair(request.param)
    yield first, second
    first.close()
    second.close()


def test_the_backend_is_found_by_its_entry_point() -> None:
    from torch.distributed._transport import available_transports

    from transport.integrations.torch_api import TorchTransport

    assert "transport" in available_transports()
    assert TorchTransport.supported() is True


def test_write_then_read_move_the_bytes(pair: tuple) -> None:
    first, second = pair
    source = torch.arange(4096, dtype=torch.int32)
    destination = torch.zeros_like(source)
    source_memory = first.register_memory(source)
    destination_memory = second.register_memory(destination)
    remote = pickle.loads(pickle.dumps(destination_memory.to_remote_buffer()))
    assert source_memory.to_view().size() == source.nbytes
    assert destination_memory.to_mutable_view(16, 32).size() == 32
    assert first.write(source_memory.to_view(), remote) == 0
    assert torch.equal(destination, source)

    back = torch.zeros_like(source)
    back_memory = first.register_memory(back)
    assert first.read(back_memory.to_mutable_view(), destination_memory.to_remote_buffer()) == 0
    assert torch.equal(back, source)


def test_a_partial_view_lands_at_the_start_and_a_registration_is_reused(pair: tuple) -> None:
    first, second = pair
    source = torch.arange(64, dtype=torch.uint8)
    destination = torch.zeros(16, dtype=torch.uint8)
    source_memory = first.register_memory(source)
    destination_memory = second.register_memory(destination)
    assert not source_memory.reused_registration()
    again = first.register_memory(source)
    assert again.reused_registration()
    assert first.write(source_memory.to_view(16, 16), destination_memory.to_remote_buffer()) == 0
    assert torch.equal(destination, source[16:32])
    # a shorter view lands at the start and leaves the rest
    assert first.write(again.to_view(40, 4), destination_memory.to_remote_buffer()) == 0
    assert torch.equal(destination[:4], source[40:44])
    assert torch.equal(destination[4:], source[20:32])
    with pytest.raises(ValueError, match="outside"):
        source_memory.to_view(source.nbytes + 1)
    with pytest.raises(ValueError, match="exceeds"):
        source_memory.to_view(60, 5)
    with pytest.raises(ValueError, match="does not fit"):
        first.write(source_memory.to_view(0, 17), destination_memory.to_remote_buffer())


def test_views_tell_read_only_from_writable() -> None:
    from torch.distributed._transport import MemoryView, MutableMemoryView

    first, second = _pair(shared=True)
    try:
        memory = first.register_memory(torch.zeros(8))
        view, mutable = memory.to_view(), memory.to_mutable_view()
        assert isinstance(view, MemoryView) and not isinstance(view, MutableMemoryView)
        assert not hasattr(view, "writable")
        assert isinstance(mutable, MutableMemoryView) and mutable.writable is True
        remote = second.register_memory(torch.zeros(8)).to_remote_buffer()
        with pytest.raises(TypeError, match="MutableMemoryView"):
            first.read(view, remote)
    finally:
        first.close()
        second.close()


def test_async_work_completes_its_future_on_its_own(pair: tuple) -> None:
    from torch.distributed._transport import Work

    first, second = pair
    source = torch.arange(1 << 20, dtype=torch.uint8)
    destination = torch.zeros_like(source)
    back = torch.zeros_like(source)
    source_memory = first.register_memory(source)
    destination_memory = second.register_memory(destination)
    back_memory = first.register_memory(back)
    remote = destination_memory.to_remote_buffer()
    write = first.write(source_memory.to_view(), remote, async_op=True)
    assert isinstance(write, Work)
    # nobody waits on the Work: its future completes by itself
    assert write.get_future().wait() == []
    assert write.is_completed() and write.is_success() and write.exception() is None
    assert torch.equal(destination, source)
    read = first.read(back_memory.to_mutable_view(), remote, async_op=True)
    assert read.wait(timedelta(seconds=30)) is True
    assert read.result() == []
    assert torch.equal(back, source)


def test_asyncio_calls_and_wait_all(pair: tuple) -> None:
    from torch.distributed._transport import wait_all

    client, server = pair
    source = torch.arange(64, dtype=torch.uint8)
    stored = torch.zeros_like(source)
    destination = torch.zeros_like(source)
    source_memory = client.register_memory(source)
    stored_memory = server.register_memory(stored)

    async def run() -> None:
        await server.read_async(stored_memory.to_mutable_view(), source_memory.to_remote_buffer())
        destination_memory = client.register_memory(destination)  # after connect
        await server.write_async(stored_memory.to_view(), destination_memory.to_remote_buffer())
        assert torch.equal(destination, source)
        destination.zero_()
        await wait_all(
            server.write(
                stored_memory.to_view(), destination_memory.to_remote_buffer(), async_op=True
            )
            for _ in range(3)
        )
        await server.close_async(timeout=10)

    asyncio.run(run())
    assert torch.equal(stored, source)
    assert torch.equal(destination, source)
    assert not server.connected()


def test_descriptors_and_urls_are_checked_bytes(pair: tuple) -> None:
    from transport.integrations.torch_api import RemoteRegion

    first, second = pair
    memory = second.register_memory(torch.zeros(4))
    remote = memory.to_remote_buffer()
    data = remote.serialize()
    assert RemoteRegion.deserialize(data) == remote
    for bad, rule in [
        (b"\xff", "not JSON"),
        (b"[]", "envelope"),
        (data.replace(b'"version":1', b'"version":2'), "version"),
        (data.replace(b'"backend":"transport"', b'"backend":"nixl"'), "backend"),
        (data.replace(b'"kind":"memory"', b'"kind":"endpoint"'), "not a memory"),
        (data.replace(b'"length":16', b'"length":-1'), "positive"),
        (data.replace(b'"length":16', b'"length":"16"'), "int"),
    ]:
        with pytest.raises(ValueError, match=rule):
            RemoteRegion.deserialize(bad)
    with pytest.raises(ValueError, match="at most"):
        RemoteRegion.deserialize(b" " * (16 << 20))
    with pytest.raises(ValueError):
        first.connect(b"{}")  # refused before the connected check: and still connected once
    with pytest.raises(RuntimeError, match="already connected"):
        first.connect(second.bind())


def test_timeouts_follow_torchs_rules(pair: tuple) -> None:
    first, second = pair
    memory = first.register_memory(torch.zeros(4))
    remote = second.register_memory(torch.zeros(4)).to_remote_buffer()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and nonnegative"):
            first.write(memory.to_view(), remote, timeout=bad)
    work = first.write(memory.to_view(), remote, async_op=True, timeout=5)
    with pytest.raises(ValueError, match="finite and nonnegative"):
        work.wait(timedelta(seconds=-1))
    assert work.wait() is True


def test_unregistered_memory_and_a_closed_endpoint_refuse_work(pair: tuple) -> None:
    first, second = pair
    source = torch.ones(16, dtype=torch.uint8)
    memory = first.register_memory(source)
    target_memory = second.register_memory(torch.zeros(16, dtype=torch.uint8))
    remote = target_memory.to_remote_buffer()
    first.unregister_memory(memory)
    first.unregister_memory(memory)  # a no-op while open
    with pytest.raises(RuntimeError, match="unregistered"):
        memory.to_view()
    fresh = first.register_memory(source)
    assert not fresh.reused_registration()
    second.unregister_memory(target_memory)
    with pytest.raises(ValueError, match="no longer exposes"):
        first.write(fresh.to_view(), remote)
    first.close()
    first.close()  # idempotent
    assert not first.connected()
    with pytest.raises(RuntimeError, match="closed"):
        first.register_memory(torch.zeros(4))
    with pytest.raises(RuntimeError, match="closed"):
        first.bind()


def test_a_remote_buffer_of_another_peer_is_refused() -> None:
    a, b = _pair(shared=False)
    c, d = _pair(shared=False)
    try:
        memory = a.register_memory(torch.zeros(4))
        foreign = d.register_memory(torch.zeros(4)).to_remote_buffer()
        with pytest.raises(ValueError, match="not to this endpoint's peer"):
            a.write(memory.to_view(), foreign)
    finally:
        for e in (a, b, c, d):
            e.close()


def test_endpoints_of_one_process_share_one_engine() -> None:
    from torch.distributed._transport import new_transport

    endpoints = [new_transport("transport", "cpu") for _ in range(4)]
    try:
        assert len({e.engine_name for e in endpoints}) == 1
        private = new_transport("transport", "cpu", shared=False)
        assert private.engine_name != endpoints[0].engine_name
        private.close()
    finally:
        for e in endpoints:
            e.close()
    # the last close closed the engine: a new endpoint starts another
    again = new_transport("transport", "cpu")
    assert again.engine_name != endpoints[0].engine_name
    again.close()


def test_an_outsider_can_neither_connect_nor_write_nor_forge() -> None:
    """With a secret, URLs and descriptors are sealed: a process without it (or with another)
    cannot load them, and what it makes is refused, a descriptor forged in a peer's name too."""
    from dataclasses import replace

    from torch.distributed._transport import new_transport

    from transport import SignatureError
    from transport.integrations.torch_api import EndpointUrl

    secret = "s3cret-s3cret"
    a, b = _pair(shared=False, secret=secret)
    outsiders = [
        new_transport("transport", "cpu", shared=False),
        new_transport("transport", "cpu", shared=False, secret="another-secret"),
    ]
    try:
        received = torch.zeros(64, dtype=torch.uint8)
        remote = b.register_memory(received).to_remote_buffer()
        for outsider in outsiders:
            with pytest.raises(SignatureError):
                outsider.connect(a.bind())
            holder = new_transport("transport", "cpu", shared=False, secret=secret)
            with pytest.raises(SignatureError):
                holder.connect(outsider.bind())
            holder.close()
            # a descriptor in b's name whose record is the outsider's: refused, nothing written
            own = outsider.register_memory(torch.zeros(64, dtype=torch.uint8)).to_remote_buffer()
            forged = replace(
                remote, region=own.region + "x", record=EndpointUrl.decode(outsider.bind()).record
            )
            memory = a.register_memory(torch.full((64,), 9, dtype=torch.uint8))
            with pytest.raises(SignatureError):
                a.write(memory.to_view(), forged)
            assert not received.any()
        # the sealed record shows an outsider nothing it could load (agent metadata, addresses)
        assert b"UCX" not in remote.record and b"m1" not in remote.record
        # the holders still move bytes
        memory = a.register_memory(torch.full((64,), 7, dtype=torch.uint8))
        a.write(memory.to_view(), remote)
        assert torch.equal(received, torch.full((64,), 7, dtype=torch.uint8))
    finally:
        for e in (a, b, *outsiders):
            e.close()


def test_an_engine_that_closes_tells_its_peers_it_left() -> None:
    """The last endpoint of an engine says so to every peer the engine connected to: they mark
    it left (as a shared store would show it), so none waits for it to answer a withdrawal."""
    from helpers.polling import wait_until

    first, second = _pair(shared=False)
    name = second.engine_name
    assert name in {p.name for p in first.engine.peers()}
    second.close()
    wait_until(
        lambda: name not in {p.name for p in first.engine.peers()}, 30, "the closed engine's leave"
    )
    first.close()
