"""The embedded store's URL, ``tcp://HOST:PORT[?timeout=SECONDS&host=auto|yes|no]``, and whether
its HOST names this machine (where ``host=auto`` serves the store)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import parse_qs, urlsplit

from transport.store.base import check_timeout

HOSTING_MODES = ("auto", "yes", "no")
_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (a loopback or wildcard address, or one it can bind)."""
    if host in _LOCAL_NAMES or host == socket.gethostname():
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def parse_tcp_url(url: str) -> tuple[str, int, str, float | None]:
    """Split ``tcp://HOST:PORT[?timeout=S&host=MODE]`` into host, port, mode and timeout."""
    rule = "a tcp store URL is tcp://HOST:PORT[?timeout=SECONDS&host=auto|yes|no]"
    parts = urlsplit(url)
    if parts.scheme != "tcp":
        raise ValueError(f"{rule}; got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{rule}; the port of {url!r} is not a number from 0 to 65535") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{rule}; {url!r} lacks the host or the port")
    if parts.username is not None or parts.path not in ("", "/"):
        raise ValueError(f"{rule}; {url!r} has a user or a path")
    options = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(options) - {"timeout", "host"})
    if unknown or any(len(v) != 1 for v in options.values()):
        raise ValueError(f"{rule}; {url!r} has unknown or repeated options {unknown or ''}")
    hosting = options.get("host", ["auto"])[0]
    if hosting not in HOSTING_MODES:
        raise ValueError(f"{rule}; host={hosting!r} is not one of auto, yes, no")
    timeout = None
    if "timeout" in options:
        try:
            timeout = check_timeout(float(options["timeout"][0]))
        except ValueError:
            raise ValueError(
                f"{rule}; timeout={options['timeout'][0]!r} is not a number of seconds >= 0"
            ) from None
    return parts.hostname, port, hosting, timeout
