"""What ``transport doctor`` found, as typed records, and how it is printed."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

#: how much a finding matters: ``fail`` stops a put, ``warn`` costs speed or safety, ``note`` says
#: what was chosen and why
LEVELS = ("fail", "warn", "note")


@dataclass(frozen=True)
class Finding:
    """One thing the doctor noticed: how much it matters, about what, and the setting or package
    that changes it (empty when nothing needs to)."""

    level: str
    topic: str
    what: str
    fix: str = ""


@dataclass(frozen=True)
class Route:
    """How UCX moves one kind of operation between two endpoints: ``between`` names them
    (``two processes on this host``, or a peer), ``operation`` is ``put``, ``get`` or
    ``notification``, ``transports`` lists UCX's choices as ``transport/device`` (over the size
    ranges UCX reported)."""

    between: str
    operation: str
    transports: tuple[str, ...]


@dataclass(frozen=True)
class StoreCheck:
    """The store: its URL (credentials redacted), how long opening it took, and the median of
    a set and a get of a small key."""

    url: str
    connect_ms: float
    round_trip_us: float


@dataclass(frozen=True)
class NameLookups:
    """The reverse lookups behind the embedded store's connections: torch's TCPStore looks up
    the name of the peer's address at both ends of each connection (for its log lines, also
    where nothing is logged), in the form it connects with, an IPv4 address mapped into IPv6
    (``address``), which hosts files seldom list. ``burst`` lookups asked one after another,
    as dozens of peers connecting at a job's start ask them: their median and slowest time."""

    address: str
    burst: int
    median_ms: float
    slowest_ms: float


@dataclass(frozen=True)
class Loopback:
    """A put between two processes of this host against a copy inside one process: the median
    time of a 4 KiB put and of a 4 KiB copy, the bandwidth of a 64 MiB put and of a 64 MiB copy."""

    put_4k_us: float
    memcpy_4k_us: float
    put_64m_gbps: float
    memcpy_64m_gbps: float


@dataclass
class Report:
    """Everything one run of the doctor found. ``settings`` holds the environment the library
    runs with (what the user set and what the library sets unless the user did); ``devices``
    the GPUs, RDMA devices and network addresses seen."""

    versions: dict[str, str]
    settings: dict[str, str]
    progress: str
    devices: dict[str, list[str]]
    store: StoreCheck | None = None
    lookups: NameLookups | None = None
    routes: list[Route] = field(default_factory=list)
    loopback: Loopback | None = None
    peer: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)

    def add(self, level: str, topic: str, what: str, fix: str = "") -> None:
        assert level in LEVELS, level
        self.findings.append(Finding(level, topic, what, fix))

    def worst(self) -> str:
        """The most serious level found (``ok`` for none)."""
        for level in LEVELS:
            if any(f.level == level for f in self.findings):
                return level
        return "ok"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def to_text(self) -> str:
        out = ["versions:"]
        out += [f"  {k:14s} {v}" for k, v in self.versions.items()]
        out.append(f"progress:        {self.progress}")
        out.append("settings:")
        out += [f"  {k:24s} {v}" for k, v in self.settings.items()]
        out.append("devices:")
        out += [f"  {k:14s} {', '.join(v) or 'none'}" for k, v in self.devices.items()]
        if self.store is not None:
            s = self.store
            out.append(
                f"store:           {s.url}: opened in {s.connect_ms:.1f} ms, "
                f"a set and a get {s.round_trip_us:.0f} us"
            )
        if self.lookups is not None:
            n = self.lookups
            out.append(
                f"name lookups:    {n.burst} of {n.address}: median {n.median_ms:.2f} ms, "
                f"slowest {n.slowest_ms:.1f} ms"
            )
        if self.routes:
            out.append("routes (UCX's choice per operation):")
            out += [
                f"  {r.between}: {r.operation:12s} {', '.join(r.transports) or '?'}"
                for r in self.routes
            ]
        if self.loopback is not None:
            lb = self.loopback
            out.append(
                f"loopback put:    4 KiB {lb.put_4k_us:.1f} us (a copy: {lb.memcpy_4k_us:.2f} us); "
                f"64 MiB {lb.put_64m_gbps:.2f} GB/s (a copy: {lb.memcpy_64m_gbps:.2f} GB/s, "
                f"{lb.put_64m_gbps / lb.memcpy_64m_gbps:.2f}x)"
            )
        if self.peer is not None:
            out.append("peer:")
            out += [f"  {k:14s} {v}" for k, v in self.peer.items()]
        out.append("findings:" if self.findings else "findings: none")
        for f in self.findings:
            out.append(f"  [{f.level}] {f.topic}: {f.what}")
            if f.fix:
                out.append(f"         fix: {f.fix}")
        return "\n".join(out)
