"""A completed put's notification outlives its sender.

Without a secret, the frames of a sender the receiver has not connected to wait until the
receiver's housekeeping thread finds the sender's agent in the store; a sender that closed right
after its put had landed has taken its record away by then. The test forces that order: the
receiver's check is held until the sender has closed (or was killed), then the notification and
a control message sent after it must arrive, and the bytes with them. With a secret, the frames'
MACs prove their sender and nothing waits for the store.
"""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers import internals
from helpers.peer import Peer, sha
from helpers.polling import wait_until

pytestmark = pytest.mark.timeout(180)

N = 1 << 20
SECRET = b"the-namespace-secret"
CHANNEL = "test/after-put"


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize("end", ["close", "kill"])
def test_a_completed_puts_notification_outlives_its_sender(tcp_store, end, secret) -> None:
    kwargs = {"secret": secret} if secret else {}
    inbox = torch.zeros(N, dtype=torch.uint8)
    control: list[tuple[str, bytes]] = []
    got_control = threading.Event()

    def on_control(peer: str, payload: bytes) -> None:
        control.append((peer, payload))
        got_control.set()

    with transport.Transport("recv", store=tcp_store.url, **kwargs) as recv:
        recv.expose("inbox", inbox, access="w")
        recv.core.on_control(CHANNEL, on_control)
        held, gate = internals.hold_sender_checks(recv)
        sender = Peer("sender", tcp_store.url, **kwargs)
        try:
            digest = sender.call("put_pattern", "recv", "inbox", N, 7, 30.0, b"done")
            sender.call("send_control", "recv", CHANNEL, b"after")
            if not secret:  # both frames wait for the check, which waits for the sender to go
                wait_until(lambda: held() == 2, 30, "the receiver holding the sender's frames")
            if end == "close":
                sender.stop()
            else:
                sender.kill()
            assert not sender.proc.is_alive()
        finally:
            gate.set()
            sender.stop()
        n = recv.wait_notification(30)
        assert (n.peer, n.payload) == ("sender", b"done")
        assert sha(inbox) == digest  # the bytes it announced are there
        assert got_control.wait(30) and control == [("sender", b"after")]
        assert recv.refused_notifications == 0
