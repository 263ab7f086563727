"""A cluster of hosts on one machine: network namespaces joined by shaped links to a switch.

Each **host** (a store, a trainer, N generators) is a network namespace with one interface,
``eth0``, the end of a veth pair whose other end is a port of a bridge, the **switch**, in a
namespace of its own. Each link is shaped in both directions (rate, delay, loss, reordering,
duplication: links.py), on the host's end (what it sends) and the switch's (what it receives).
The hosts have addresses in 198.18.0.0/24 (a benchmarking range) that exist only inside them:
nothing touches an interface, address or route of the machine's own namespace, which cannot
reach the hosts and which they cannot reach.

Processes in a host see the others only through the links. UCX, left alone, would still move
bytes between them through shared memory or CMA (they share one kernel), so every process the
cluster starts gets ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=eth0`` (:meth:`Cluster.env`), and the
links' byte counters (:meth:`Cluster.traffic`) show what crossed them.

Names: every namespace this module makes starts with ``PREFIX`` and the cluster's number, and
a state file names them and the process that owns the cluster (leftovers.py). :meth:`Cluster.close` (and leaving its ``with`` block, Ctrl-C included) kills the
processes in its hosts and removes what it made; :func:`clean_leftovers` (run by every new
cluster) removes the clusters whose owner process is gone: a run that crashed or was killed.
Making namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; without them a
cluster refuses at once and says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from transport.cluster.leftovers import (
    PREFIX,
    check_rights,
    claim_number,
    clean_leftovers,
    ip,
    remove,
    run,
    save_state,
)
from transport.cluster.links import Link, Shaper
from transport.errors import ClusterError

log = logging.getLogger(__name__)

#: the hosts' network; the store is .1, the trainer .2, generator i is .10 + i
NETWORK = "198.18.0"
MAX_GENERATORS = 200
#: where the store host's store listens (the embedded store; Redis)
STORE_PORT, REDIS_PORT = 29517, 6379

#: the embedded store, hosted in the store host until the process is killed
_TCP_STORE = """
import signal, sys
from transport.store.tcp import TcpStore
store = TcpStore(sys.argv[1], int(sys.argv[2]), hosting="yes")
signal.pause()
"""
#: exits 0 once a TCP connection to (address, port) is accepted, 1 at the deadline
_PROBE = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        sys.exit(0)
    except OSError as e:
        if time.monotonic() > deadline:
            sys.exit(f"nothing listens on {sys.argv[1]}:{sys.argv[2]}: {e}")
        time.sleep(0.05)
"""


@dataclass(frozen=True)
class Host:
    """One host of a cluster: its ``role`` (``store``, ``trainer``, ``gen0`` ...), its network
    ``namespace``, its ``address``, and ``port``, the switch's end of its link."""

    role: str
    namespace: str
    address: str
    port: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass(frozen=True)
class Traffic:
    """Bytes a host sent and received over its link since the cluster came up."""

    sent: int
    received: int


@dataclass
class Cluster:
    """A store host, a trainer host and ``generators`` generator hosts on one switch, every
    link shaped as ``link``. It owns the namespaces and interfaces it made, the processes it
    started (:meth:`start`), and its state file. Rules: :meth:`up` makes everything or nothing
    (what it made is removed when a step fails); :meth:`close` kills every process in its hosts
    and removes every namespace (their interfaces go with them), and is safe to call twice;
    nothing of the machine's own namespace is touched. Use it as a context manager."""

    generators: int
    link: Link = field(default_factory=Link)
    number: int = 0
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)
    _baseline: dict[str, Traffic] = field(default_factory=dict)
    _shaper: Shaper = field(default_factory=Shaper)
    #: the process of the store :meth:`start_store` started last (None before)
    store_process: subprocess.Popen[Any] | None = None

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.number}-switch"

    @property
    def trainer(self) -> Host:
        return self.hosts["trainer"]

    @property
    def store_host(self) -> Host:
        return self.hosts["store"]

    def generator(self, i: int) -> Host:
        return self.hosts[f"gen{i}"]

    def up(self) -> Cluster:
        """Make the cluster (cleaning what dead runs left first); ClusterError if it cannot."""
        if not 1 <= self.generators <= MAX_GENERATORS:
            raise ValueError(
                f"generators must be from 1 to {MAX_GENERATORS}, got {self.generators}"
            )
        check_rights()
        clean_leftovers()
        self.number = claim_number()
        roles = ["store", "trainer", *(f"gen{i}" for i in range(self.generators))]
        ends = {"store": 1, "trainer": 2} | {f"gen{i}": 10 + i for i in range(self.generators)}
        for role in roles:
            short = role[0] if role in ("store", "trainer") else f"g{role[3:]}"
            self.hosts[role] = Host(
                role,
                f"{PREFIX}{self.number}-{role}",
                f"{NETWORK}.{ends[role]}",
                f"{PREFIX}{self.number}{short}",
            )
        self._save()
        try:
            ip("netns", "add", self.switch)
            ip("-n", self.switch, "link", "add", "sw", "type", "bridge")
            ip("-n", self.switch, "link", "set", "sw", "up")
            for host in self.hosts.values():
                self._plug(host)
            self._baseline = self._counters()
        except BaseException:
            self.close()
            raise
        log.info("cluster %d up: %d generators, links %s", self.number, self.generators, self.link)
        return self

    def _plug(self, host: Host) -> None:
        """Make ``host``'s namespace and its link to the switch, shaped both ways."""
        ip("netns", "add", host.namespace)
        ip(
            "-n",
            host.namespace,
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            host.port,
            "netns",
            self.switch,
        )
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", self.switch, "link", "set", host.port, "master", "sw")
        ip("-n", self.switch, "link", "set", host.port, "up")
        self.shape(host, self.link)

    def shape(self, host: Host, link: Link) -> None:
        """Shape ``host``'s link as ``link`` from now on, in both directions, replacing what it
        had (``Link("1gbit")`` takes its loss, reordering and duplication away)."""
        for namespace, dev in ((host.namespace, "eth0"), (self.switch, host.port)):
            self._shaper.shape(namespace, dev, link)
        self._shaper.lose(host.namespace, link.loss)

    def cut(self, host: Host, cut: bool = True) -> None:
        """Take ``host``'s link down (``cut=False``: up again), at the switch's end: the host's
        own interface stays as it was, as when a cable is pulled at the other end."""
        ip("-n", self.switch, "link", "set", host.port, "down" if cut else "up")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process in a host: the machine's, with UCX kept to TCP over
        the host's link (and gloo on it)."""
        return {
            **os.environ,
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            "GLOO_SOCKET_IFNAME": "eth0",
            **(extra or {}),
        }

    def start(
        self,
        host: Host,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host`` (a process group of its own); :meth:`close` kills it."""
        proc = subprocess.Popen(
            host.command(argv),
            env=self.env(env),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            text=True,
        )
        self.processes.append(proc)
        return proc

    def start_store(
        self, kind: str = "tcp", timeout: float = 60.0, probe_from: Host | None = None
    ) -> str:
        """Start a store in the store host, reachable from every host, and return its URL:
        ``tcp`` the embedded store (TCPStore), ``redis`` a Redis server (Debian's
        ``redis-server``); :attr:`store_process` is its process. ClusterError if it does not
        listen within ``timeout`` seconds, as seen from ``probe_from`` (default: the trainer's
        host, through the links; the store's own host sees it whatever the links do)."""
        host = self.store_host
        if kind == "tcp":
            argv = [sys.executable, "-c", _TCP_STORE, host.address, str(STORE_PORT)]
            url = f"tcp://{host.address}:{STORE_PORT}?host=no"
        elif kind == "redis":
            if shutil.which("redis-server") is None:
                raise ClusterError("a Redis store needs redis-server: apt-get install redis-server")
            argv = [
                "redis-server",
                "--bind",
                host.address,
                "--port",
                str(REDIS_PORT),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ]
            url = f"redis://{host.address}:{REDIS_PORT}/0"
        else:
            raise ValueError(f"a cluster's store is 'tcp' or 'redis', got {kind!r}")
        # its errors go to a file, not a pipe: a pipe nobody reads blocks the store once full (a
        # TCPStore warns on stderr at connections), and every call of every host with it; the
        # store keeps writing to the file, which goes once it ends
        with tempfile.TemporaryFile() as errors:
            proc = self.start(host, argv, stdout=subprocess.DEVNULL, stderr=errors)
            self.store_process = proc
            # listening: a connection from the trainer's host (through the links) is accepted
            probe = [
                sys.executable,
                "-c",
                _PROBE,
                host.address,
                str(STORE_PORT if kind == "tcp" else REDIS_PORT),
                str(timeout),
            ]
            done = subprocess.run(
                (probe_from or self.trainer).command(probe),
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=timeout + 30,
            )
            if done.returncode != 0 or proc.poll() is not None:
                errors.seek(0)
                err = errors.read().decode(errors="replace") if proc.poll() is not None else ""
                raise ClusterError(
                    f"the {kind} store did not start in {host.namespace}: "
                    f"{(err or done.stderr).strip()[-500:]}"
                )
        return url

    def traffic(self) -> dict[str, Traffic]:
        """Per host role, the bytes its link carried since :meth:`up` (from the kernel's
        counters of its interface)."""
        now = self._counters()
        return {
            role: Traffic(
                t.sent - self._baseline[role].sent, t.received - self._baseline[role].received
            )
            for role, t in now.items()
        }

    def _counters(self) -> dict[str, Traffic]:
        out = {}
        for role, host in self.hosts.items():
            raw = run(["ip", "-j", "-s", "-n", host.namespace, "link", "show", "dev", "eth0"])
            stats = json.loads(raw)[0]["stats64"]
            out[role] = Traffic(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def close(self) -> None:
        """Kill every process in the hosts, remove the namespaces (their interfaces go with
        them) and the state file."""
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.processes = []
        if self.number:
            remove(self.number, [h.namespace for h in self.hosts.values()] + [self.switch])
            self.number = 0

    def _save(self) -> None:
        save_state(self.number, [h.namespace for h in self.hosts.values()] + [self.switch])

    def __enter__(self) -> Cluster:
        return self.up() if not self.number else self

    def __exit__(self, *exc: object) -> None:
        self.close()
