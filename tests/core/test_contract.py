"""The internal contract of the layers above the core (``Transport.core``), on the loopback
backend: control messages route to one handler per channel, a put that carries one delivers it
after its data, and a stopped handler frees its channel."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from transport.store import MemoryStore

pytestmark = pytest.mark.unit


def test_control_messages_reach_the_one_handler_of_their_channel_after_the_data():
    store = MemoryStore()
    with (
        transport.Transport("ctl-w", store=store, backend="loopback", timeout=10) as w,
        transport.Transport("ctl-r", store=store, backend="loopback", timeout=10) as r,
    ):
        buf = torch.zeros(4096, dtype=torch.uint8)
        r.expose("buf", buf)
        got: list[tuple[str, bytes, bool]] = []
        arrived = threading.Event()

        def handler(peer: str, payload: bytes) -> None:
            got.append((peer, payload, bool(buf.eq(9).all())))
            arrived.set()

        stop = r.core.on_control("chan", handler)
        with pytest.raises(ValueError, match="already has a handler"):
            r.core.on_control("chan", handler)
        w.wait_for_peer("ctl-r", 5)
        w.core.put_control(
            {"buf": torch.full((4096,), 9, dtype=torch.uint8)}, "ctl-r", "chan", b"landed", 5
        ).wait(5)
        assert arrived.wait(5)
        assert got == [("ctl-w", b"landed", True)]  # the data was there when the message came
        assert w.core.peer("ctl-r").regions["buf"].nbytes == 4096

        stop()
        again = threading.Event()
        r.core.on_control("chan", lambda peer, payload: again.set())  # the channel is free again
        w.core.send_control("ctl-r", "chan", b"x")
        assert again.wait(5)
        assert got == [("ctl-w", b"landed", True)]  # the stopped handler heard nothing more
    store.close()


def test_a_second_subscriber_of_a_group_on_one_transport_is_refused():
    store = MemoryStore()

    def workers() -> set[threading.Thread]:
        return {th for th in threading.enumerate() if th.name == "transport-ws-sub-g"}

    others = workers()  # of other tests in this process (a group "g" of their own)
    with transport.Transport("ctl-g", store=store, backend="loopback", timeout=10) as t:
        first = transport.WeightSubscriber(t, {"w": torch.zeros(16)}, group="g")
        with pytest.raises(ValueError, match="already has a handler"):
            transport.WeightSubscriber(t, {"w": torch.zeros(16)}, group="g")
        assert len(workers() - others) == 1  # the refused one stopped its worker
        first.close()
    store.close()
