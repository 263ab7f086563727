"""The doorbell: how a sleeping progress engine is woken, by its own threads and by its peers.

An engine with nothing in flight sleeps (no timer polls): a thread of ours wakes it through an
eventfd (a transfer to post, a wait that began, a close), and a peer that writes to it, reads from
it or notifies it rings its doorbell, a UDP datagram that carries the token of the incarnation it
writes to. The datagram says only "look now": the engine then makes progress and reads
notifications as it does after any activity, and backs off to sleep again once nothing happened
for a while. A ring that is lost (UDP) costs latency only: the writer rings again while its
transfer is in flight, and the engine's longest sleep bounds the rest.

Where a peer sends it: the address and token are in the peer's record (``PeerRecord.bell``),
sealed with the namespace's secret when there is one, so a process without the secret cannot
read the token, and a datagram without the right token wakes nothing (it is counted; a flood
of them costs a read each, at most ``MAX_READ`` per wake-up, and never any progress). The
address is the one this host uses to reach the store (peers that share a store reach each
other), unless ``$TRANSPORT_BELL_IP`` names another.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from transport.backends.base import Backend

#: the bytes of a doorbell token
TOKEN_BYTES = 16
#: a writer rings a peer at most this often (seconds): a rung engine stays awake far longer
RING_EVERY = 0.05
#: the environment variable that names the address our doorbell listens on
BELL_IP_ENV = "TRANSPORT_BELL_IP"
#: a sleep longer than this is deep: a transfer posted by another thread wakes the engine from it
#: (from a shorter one the engine comes back soon enough by itself)
DEEP_S = 1e-3
#: datagrams read per wake-up at most (a flood costs a bounded read per wake)
MAX_READ = 64


@dataclass(frozen=True)
class Bell:
    """Where a peer's doorbell is (published in its record): an IP address, a UDP port, the
    token a ring must carry, and whether its writers and readers ring too (``data``: it makes
    progress only in its engine, so nothing lands over TCP unless that engine is awake) or only
    its notifiers (NIXL's progress thread lands the bytes; only a notification needs the
    engine)."""

    ip: str
    port: int
    token: bytes
    data: bool = True

    def pack(self) -> bytes:
        """The bell as a record carries it: token, flags (1 byte: 1 for ``data``), port (2 bytes),
        address (4 or 16 bytes)."""
        return (
            self.token
            + bytes([int(self.data)])
            + self.port.to_bytes(2, "big")
            + ipaddress.ip_address(self.ip).packed
        )

    @staticmethod
    def unpack(data: bytes) -> Bell | None:
        """The bell a record carries (None for none); ValueError, naming the rule, for bytes
        that are not one."""
        if not data:
            return None
        if len(data) not in (TOKEN_BYTES + 7, TOKEN_BYTES + 19):
            raise ValueError(
                f"a doorbell is {TOKEN_BYTES + 7} or {TOKEN_BYTES + 19} bytes, got {len(data)}"
            )
        flags = data[TOKEN_BYTES]
        if flags > 1:
            raise ValueError(f"a doorbell's flags are 0 or 1, got {flags}")
        port = int.from_bytes(data[TOKEN_BYTES + 1 : TOKEN_BYTES + 3], "big")
        if port == 0:
            raise ValueError("a doorbell's port is 0")
        ip = ipaddress.ip_address(bytes(data[TOKEN_BYTES + 3 :]))
        return Bell(str(ip), port, bytes(data[:TOKEN_BYTES]), bool(flags))


def bell_ip(store_url: str | None) -> str:
    """The address our doorbell listens on: ``$TRANSPORT_BELL_IP``, else the local address of
    the route to the store's host, else the loopback address (an in-process store)."""
    given = os.environ.get(BELL_IP_ENV)
    if given:
        try:
            return str(ipaddress.ip_address(given))
        except ValueError:
            raise ValueError(
                f"${BELL_IP_ENV}={given!r} is not an IP address; name one of this host's "
                "addresses that its peers reach, or unset it"
            ) from None
    parts = urlsplit(store_url or "")
    host = parts.hostname
    if not host or parts.scheme == "memory":
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, parts.port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # no packet is sent: this only asks the kernel for the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class Doorbell:
    """The wake-up of one progress engine. It owns an eventfd (our threads' wake-ups) and, when
    ``ip`` is given, a UDP socket on it (peers' rings), until :meth:`close`; ``data`` says
    whether peers ring for writes and reads too (see :class:`Bell`).

    Rules: :meth:`wake` may be called from any thread and costs a system call only while the
    engine sleeps; only the engine's thread calls :meth:`sleep`. A ring counts only with our
    token (:attr:`refused` counts the others); at most :data:`MAX_READ` datagrams are read per
    wake-up. :meth:`ring` sends on the same socket.
    """

    def __init__(self, ip: str | None = None, data: bool = True) -> None:
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._efd, select.POLLIN)
        self._sock: socket.socket | None = None
        self.bell: Bell | None = None
        if ip is not None:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            self._sock = socket.socket(family, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
            try:
                self._sock.bind((ip, 0))
            except OSError as e:
                self._sock.close()
                os.close(self._efd)
                raise ValueError(
                    f"the doorbell cannot listen on {ip} ({e}); set ${BELL_IP_ENV} to an address "
                    "of this host that its peers reach"
                ) from None
            self._poll.register(self._sock.fileno(), select.POLLIN)
            port = self._sock.getsockname()[1]
            self.bell = Bell(ip, port, secrets.token_bytes(TOKEN_BYTES), data)
        self._sleeping = False
        self.deep = False  # sleeping for longer than DEEP_S: a new transfer wakes it
        self._woken = False
        self._event = threading.Event()  # short sleeps wait on it
        self._lock = threading.Lock()
        self._closed = False
        self.rings = 0  # rings that woke us (or found us awake)
        self.refused = 0  # datagrams without our token
        self.sent = 0  # rings we sent

    @classmethod
    def listen(cls, store_url: str | None, backend: Backend) -> Doorbell:
        """The doorbell of a Transport whose store is at ``store_url`` and whose agent is
        ``backend`` (which decides ``data``); ``backend`` is closed if it cannot listen."""
        try:
            return cls(bell_ip(store_url), backend.progress != "events")
        except BaseException:
            backend.close()
            raise

    def wake(self) -> None:
        """Wake the engine now (or make its next sleep return at once)."""
        self._woken = True
        self._event.set()
        if self._sleeping:
            with self._lock:  # never a write to a closed (and perhaps reused) descriptor
                if not self._closed:
                    os.eventfd_write(self._efd, 1)

    def sleep(self, timeout: float | None) -> bool:
        """Engine thread: sleep until woken or ``timeout`` seconds (None: no limit); True when a
        peer rang. A sleep of at most :data:`DEEP_S` is a short one, timed to the microsecond,
        that reads no rings (the engine is awake and making progress anyway: it calls
        :meth:`rings_waiting` now and then); a longer one is deep, and a ring ends it."""
        if timeout is not None and timeout <= DEEP_S:
            self._event.wait(timeout)
            self._event.clear()
            self._woken = False
            return False
        self._sleeping = self.deep = True  # then look at _woken: a wake() sees this or is seen
        try:
            ms = -1 if timeout is None else int(timeout * 1000 + 0.999)
            events = self._poll.poll(0 if self._woken else ms)
        finally:
            self._sleeping = self.deep = False
        self._woken = False  # before the engine looks at its queues again
        self._event.clear()
        rang = False
        for fd, _ in events:
            if fd == self._efd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._efd)
            else:
                rang = self.rings_waiting()
        return rang

    def rings_waiting(self) -> bool:
        """Read the rings that came (without blocking); True if one carried our token."""
        if self._sock is None or self.bell is None:
            return False
        token = self.bell.token
        rang = False
        for _ in range(MAX_READ):
            try:
                data = self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # an ICMP error of one of our own sends, or closed: nothing to read
            if hmac.compare_digest(data, token):
                rang = True
            else:
                self.refused += 1
        if rang:
            self.rings += 1
        return rang

    def ring(self, bell: Bell) -> None:
        """Ring a peer's doorbell from our socket (never blocks; a lost or refused datagram is
        only latency). A doorbell without a socket (a lane's) rings nobody: its connections
        ring through the Transport's."""
        if self._sock is None:
            return
        self.sent += 1
        # a full buffer, an unreachable network or a closed socket: the writer rings again
        with contextlib.suppress(OSError):
            self._sock.sendto(bell.token, (bell.ip, bell.port))

    def close(self) -> None:
        """After the engine's thread ended: later wake-ups and rings do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._sock is not None:
                self._sock.close()
            os.close(self._efd)


class Ringer:
    """The ringing of one peer's doorbell by one engine: at most once per :data:`RING_EVERY`
    (a rung engine stays awake far longer), so a writer's every transfer may ask for it; a
    transfer without a notification rings only a peer whose bell asks for it (``Bell.data``).
    It owns nothing but the time of its last ring; without a bell it does nothing."""

    __slots__ = ("_bell", "_doorbell", "_last", "data")

    def __init__(self, doorbell: Doorbell | None, bell: Bell | None) -> None:
        self._doorbell = doorbell if bell is not None else None
        self._bell = bell
        self._last = -1.0
        #: whether transfers without a notification ring too
        self.data = bell is not None and bell.data

    def __call__(self, now: float | None = None, notify: bool = True) -> None:
        if self._doorbell is None or not (notify or self.data):
            return
        now = time.monotonic() if now is None else now
        if now - self._last >= RING_EVERY:
            self._last = now
            assert self._bell is not None
            self._doorbell.ring(self._bell)
