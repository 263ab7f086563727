"""The flight recorder: a ring of the last transfer events of one Transport, dumped to a file when
something goes wrong (by every Transport of the namespace at once), on SIGUSR1, or on demand.

Events: ``post`` (a transfer handed to NIXL), ``done`` / ``error`` / ``timeout`` (how it ended),
``notif`` (a notification arrived), ``join`` (a connection to a peer incarnation), ``leave`` (a
connection dropped: the peer left or restarted), ``lost`` (a peer died), ``suspect`` (a peer did
not complete a transfer by its deadline), ``withdraw`` (a region unexposed), ``dump``.
Each has the monotonic time (wall-clock time comes from one offset taken at dump), the peers, the
bytes, the region names and the handle id. Recording is one tuple appended to a deque. Small puts
and gets that complete inside their post (they cannot stall) are only counted, in the header's
``inline_completed``: the fastest path pays nothing measurable for the recorder.

A dump is one JSON-lines file: a header (who, why, clocks), then the events, oldest first.
``transport trace DIR`` merges the dumps of every peer into one timeline and names the transfers
that never completed and the peers that went silent.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: the directory automatic dumps (errors, dump requests, SIGUSR1) go to, when no trace_dir= is given
ENV_DIR = "TRANSPORT_TRACE_DIR"
DEFAULT_CAPACITY = 65536

#: handle ids, unique in the process (next(handle_ids))
handle_ids = itertools.count(1)


class FlightRecorder:
    """A ring of the newest ``capacity`` events (0: record nothing)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"trace_capacity must be a non-negative int, got {capacity!r}")
        self.capacity = capacity
        self._ring: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=capacity or 1)
        self._dumps = itertools.count(1)
        self._lock = threading.Lock()  # one dump at a time
        #: called (on the thread that saw it) when a transfer ends in an error or a timeout
        self.on_error: Callable[[str], None] | None = None
        #: the hot paths' record: appends one event tuple (monotonic ns, kind, handle id, op,
        #: peers, bytes, keys, info) as is; None when nothing is recorded
        self.append: Callable[[tuple[Any, ...]], None] | None = (
            self._ring.append if capacity else None
        )

    def record(
        self,
        kind: str,
        hid: int = 0,
        op: str = "",
        peers: Any = "",
        nbytes: int = 0,
        keys: Any = None,
        info: str = "",
    ) -> None:
        if self.capacity:
            self._ring.append((time.monotonic_ns(), kind, hid, op, peers, nbytes, keys, info))

    def events(self) -> list[dict[str, Any]]:
        """The ring, oldest first, as dicts (``t`` is wall-clock nanoseconds)."""
        offset = time.time_ns() - time.monotonic_ns()
        out = []
        for mono, kind, hid, op, peers, nbytes, keys, info in list(self._ring):
            out.append(
                {
                    "t": mono + offset,
                    "mono": mono,
                    "kind": kind,
                    "handle": hid,
                    "op": op,
                    "peers": _peers(peers),
                    "bytes": nbytes,
                    "keys": _keys(keys),
                    "info": info,
                }
            )
        return out if self.capacity else []

    def dump(self, directory: str | os.PathLike[str], header: dict[str, Any]) -> Path:
        """Write the ring to a new file in ``directory``; returns its path."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.record("dump", info=str(header.get("reason", ""))[:200])
            n = next(self._dumps)
            name = f"{header['namespace']}.{header['name']}.{header['generation']}.{os.getpid()}.{n}.jsonl"
            path = d / name
            head = {
                **header,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "dumped_at": time.time_ns(),
                "capacity": self.capacity,
                "format": "transport-trace/1",
            }
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps(head) + "\n")
                for e in self.events():
                    f.write(json.dumps(e) + "\n")
            os.replace(tmp, path)  # a reader never sees half a dump
        return path


def _peers(p: Any) -> list[str]:
    if isinstance(p, str):
        return [p] if p else []
    return [str(x) for x in p]


def _keys(k: Any) -> list[str] | None:
    """Region names: a name, a tuple of (name, tensor) items, or names; long batches abridged."""
    if k is None:
        return None
    if isinstance(k, str):
        return [k]
    names = [x[0] if isinstance(x, tuple) else str(x) for x in k]
    return names if len(names) <= 8 else [*names[:8], f"... {len(names)} regions"]


# -- reading dumps (transport trace) ---------------------------------------------------------------


def load(paths: Iterable[Path]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(header, events) of every dump; unreadable files are skipped with a note in the header."""
    out = []
    for p in sorted(paths):
        try:
            with open(p) as f:
                lines = f.read().splitlines()
            head = json.loads(lines[0])
            if head.get("format") != "transport-trace/1":
                continue
            events = [json.loads(line) for line in lines[1:] if line.strip()]
        except (OSError, ValueError, IndexError):
            continue
        head["file"] = p.name
        out.append((head, events))
    return out


def analyze(dumps: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> dict[str, Any]:
    """The merged timeline, the transfers that never completed (per dumping Transport: posted,
    never ended), and the peers that went silent: named by unfinished transfers, and either
    without a dump of their own or with none of their events after the oldest such transfer."""
    timeline = []
    newest: dict[tuple[str, int], tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for head, events in dumps:
        key = (head["name"], head["generation"])
        if key not in newest or head["dumped_at"] > newest[key][0]["dumped_at"]:
            newest[key] = (head, events)
    for (name, gen), (_, events) in newest.items():
        for e in events:
            timeline.append({**e, "at": f"{name}#{gen}"})
    timeline.sort(key=lambda e: e["t"])
    unfinished = []
    for (name, gen), (head, events) in newest.items():
        posted: dict[int, dict[str, Any]] = {}
        ended: set[int] = set()  # (an end can be recorded just before its post, by another thread)
        for e in events:
            if e["kind"] == "post":
                posted[e["handle"]] = e
            elif e["kind"] in ("done", "error", "timeout"):
                ended.add(e["handle"])
        for hid, e in posted.items():
            if hid in ended:
                continue
            unfinished.append(
                {**e, "at": f"{name}#{gen}", "age_s": (head["dumped_at"] - e["t"]) / 1e9}
            )
    last_seen: dict[str, int] = {}
    for (name, _), (_, events) in newest.items():
        if events:
            last_seen[name] = max(last_seen.get(name, 0), events[-1]["t"])
    failing: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in unfinished:
        for p in e["peers"]:
            failing[p].append(e)
    for e in timeline:
        if e["kind"] == "timeout":
            for p in e["peers"]:
                failing[p].append(e)
    silent = []
    for peer, evs in sorted(failing.items()):
        since = min(e["t"] for e in evs)
        if peer not in last_seen:
            why = "no dump from it (frozen, dead, or without a trace directory)"
        elif last_seen[peer] < since:
            why = "its own last event is older than the transfers that wait for it"
        else:
            continue
        silent.append({"peer": peer, "why": why, "transfers": len(evs), "since": since})
    return {
        "timeline": timeline,
        "unfinished": unfinished,
        "silent": silent,
        "dumps": [h for h, _ in dumps],
    }
