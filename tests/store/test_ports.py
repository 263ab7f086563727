"""Ports held for a server that binds them later by number (transport/store/ports.py)."""

from __future__ import annotations

import errno
import socket

import pytest

from transport.store import TcpStore, reserve_port

pytestmark = [pytest.mark.stores, pytest.mark.timeout(60)]


def _bind(port: int, reuse: bool) -> socket.socket:
    s = socket.socket()
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except BaseException:
        s.close()
        raise
    return s


def test_a_held_port_is_refused_to_a_plain_bind_and_the_embedded_store_hosts_on_it():
    with reserve_port() as held:
        with pytest.raises(OSError) as refused:
            _bind(held.port, reuse=False).close()
        assert refused.value.errno == errno.EADDRINUSE
        # a client before the server is refused, as with nobody on the port
        with socket.socket() as early, pytest.raises(ConnectionRefusedError):
            early.connect(("127.0.0.1", held.port))
        host = TcpStore("127.0.0.1", held.port, hosting="yes")
        client = TcpStore("127.0.0.1", held.port, hosting="no", timeout=10)
        try:
            assert host.is_host and host.port == held.port
            client.set("k", b"\x00bytes\xff")
            assert host.get("k", timeout=10) == b"\x00bytes\xff"
        finally:
            client.close()
            host.close()


def test_no_port_asked_for_by_number_zero_is_a_held_one():
    """The kernel skips a held port when it picks one: thousands of picks land on none of 64
    held ports (closed right after their pick, the same ports come back within such a run)."""
    held = [reserve_port() for _ in range(64)]
    try:
        ports = {h.port for h in held}
        picked = set()
        for k in range(4000):
            with _bind(0, reuse=k % 2 == 0) as s:
                picked.add(s.getsockname()[1])
        assert not picked & ports, sorted(picked & ports)
        assert len(picked) > 1000  # the picks spread over the range
    finally:
        for h in held:
            h.close()


def test_closing_gives_the_port_back_and_twice_is_nothing():
    held = reserve_port("127.0.0.1")
    assert "held" in repr(held) and not held.closed
    held.close()
    held.close()
    assert held.closed and "closed" in repr(held)
    _bind(held.port, reuse=False).close()
