"""TCP ports held for a server that another process (or a later call) binds by number.

Picking a "free" port by binding port 0 and closing the socket leaves a window until the server
binds it: meanwhile the kernel may hand the same port to anyone else who asks for any port (a
listener bound to port 0, an outgoing connection), and the server then fails with EADDRINUSE.
On a host that opens thousands of connections a minute (a test suite, a node with many peers)
that window is hit. A :class:`PortReservation` closes it.
"""

from __future__ import annotations

import socket

from transport._closing import Closing


class PortReservation(Closing):
    """Owns one socket bound to ``port`` with ``SO_REUSEADDR`` that never listens.

    While it is open, the kernel gives the port to no one who asks for any port (binding port
    0, or the local end of an outgoing connection), and a server that binds the port by number
    with ``SO_REUSEADDR`` still can: torch's TCPStore (so this library's embedded store),
    uvicorn (so vLLM's API server) and Redis all do. Rules: the reservation does not accept
    connections (a client that comes before the server is refused, as with no reservation);
    a server that binds without ``SO_REUSEADDR`` is refused the port; close the reservation
    once the server is gone, or let this process end, which closes it. Closing twice is a
    no-op; ``with`` closes it.
    """

    def __init__(self, host: str = "") -> None:
        self._sock: socket.socket | None = socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
        )
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
        except BaseException:
            self._sock.close()
            raise
        self.host = host
        self.port = int(self._sock.getsockname()[1])

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Gives the port back to the kernel."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "held"
        return f"PortReservation({self.host or '*'}:{self.port}, {state})"


def reserve_port(host: str = "") -> PortReservation:
    """A port of this host held until the reservation is closed (``host`` ``""``: every
    address, which is what a server binding all of them needs)."""
    return PortReservation(host)
