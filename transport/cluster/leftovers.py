"""What a cluster leaves on the machine, and how a later one cleans what a dead run left.

Every namespace a cluster makes is named :data:`PREFIX`, its number, and a role; a state file in
:data:`STATE_DIR` (one per cluster number, claimed by creating it) names them and the process
that owns the cluster, with that process's start time (a later process given the same number
is not the owner). :func:`clean_leftovers` removes the clusters whose owner is gone: killing
every process still in their namespaces, then the namespaces (their interfaces go with them).
Cleaning and claiming a number hold one lock (a file in :data:`STATE_DIR`): a number is claimed
again only once the removal of the dead cluster that held it is over, so a slower cleaner never
removes the namespaces of a new cluster of the same number.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from transport.errors import ClusterError

#: the start of every namespace and interface name a cluster makes
PREFIX = "tpc"
#: where each cluster's state file lives (names, owner): read by later clusters to clean up
STATE_DIR = Path(os.environ.get("TRANSPORT_CLUSTER_STATE", "/run/transport-cluster"))
#: how long a claimed state file may stay empty before a later cluster takes it for a leftover
CLAIM_S = 60.0


def check_rights() -> None:
    """ClusterError at once, naming what is missing, unless this process can make namespaces."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"a cluster of namespaces needs iproute2 ({' and '.join(missing)} not found): "
            "apt-get install iproute2"
        )
    if os.geteuid() != 0:
        raise ClusterError(
            "a cluster of namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to make network "
            "namespaces and links); run it as root, or in a container started with those rights"
        )


@dataclass(frozen=True)
class State:
    """What a cluster's state file says: its ``namespaces`` (named ``prefix``-role), its
    ``owner`` process (-1: not written yet, or unreadable) and whether that process is
    ``alive`` (a file claimed but not yet written, for a while, counts as alive)."""

    prefix: str
    namespaces: tuple[str, ...]
    owner: int
    alive: bool


def load_states() -> dict[int, State]:
    """Every cluster's state, by number."""
    out = {}
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        if not path.stem.isdigit():
            continue
        try:
            state = json.loads(path.read_text())
            owner, started = int(state["owner"]), state.get("started")
            namespaces = tuple(str(n) for n in state["namespaces"])
        except (OSError, ValueError, KeyError, TypeError):
            owner, started, namespaces = -1, None, ()
        alive = owner > 0 and started is not None and _boot_time_of(owner) == started
        with contextlib.suppress(OSError):  # claimed, not yet written: a cluster coming up
            alive = alive or (owner == -1 and time.time() - path.stat().st_mtime < CLAIM_S)
        out[int(path.stem)] = State(f"{PREFIX}{path.stem}", namespaces, owner, alive)
    return out


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold the lock of cleaning and claiming (released when the file closes, by a killed
    process too)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def clean_leftovers(everything: bool = False) -> list[int]:
    """Remove the clusters whose owner process is gone (``everything``: all of them, owned or
    not); returns their numbers. Namespaces of ours that no state file names (a run killed
    while it was saving) are removed too when no live cluster could be making them."""
    with _locked():
        return _clean(everything)


def _clean(everything: bool) -> list[int]:
    removed: list[int] = []
    named: set[str] = set()
    live = False
    for number, state in load_states().items():
        if state.alive and not everything:
            named.update(state.namespaces)
            live = True
            continue
        remove(number, state.namespaces)
        removed.append(number)
    if not live:  # nobody can be making a cluster now: anything of ours left is a leftover
        for namespace in _namespaces():
            if namespace.startswith(PREFIX) and namespace not in named:
                _remove_namespace(namespace)
    return removed


def remove(number: int, namespaces: Sequence[str]) -> None:
    """Remove cluster ``number``: its namespaces (killing what runs in them), its state file."""
    for namespace in namespaces:
        _remove_namespace(namespace)
    with contextlib.suppress(FileNotFoundError):
        _state_file(number).unlink()


def _remove_namespace(namespace: str) -> None:
    """Kill the processes in ``namespace`` and remove it."""
    if namespace not in _namespaces():
        return
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
    ).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists()]
        if pids:
            time.sleep(0.05)  # the kernel reaps them; the namespace goes with the last
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def claim_number() -> int:
    """The smallest number no state file holds, claimed by creating its file."""
    with _locked():
        for number in range(1, 100000):
            try:
                fd = os.open(_state_file(number), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            os.close(fd)
            return number
    raise ClusterError(f"no free cluster number in {STATE_DIR}: run `transport cluster down --all`")


def _state_file(number: int) -> Path:
    return STATE_DIR / f"{number}.json"


def _boot_time_of(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later process
    given the same number; None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def ip(*args: str) -> str:
    """``ip ARGS``' output; ClusterError with its message when it fails."""
    return run(["ip", *args])


def run(argv: list[str]) -> str:
    """``argv``'s output; ClusterError with its message when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"`{' '.join(argv)}` failed: {e}") from e
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def save_state(number: int, namespaces: Sequence[str]) -> None:
    """Name cluster ``number``'s namespaces and this process as their owner (atomically)."""
    state = {
        "owner": os.getpid(),
        "started": _boot_time_of(os.getpid()),
        "namespaces": list(namespaces),
    }
    path = _state_file(number)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # whole or not at all, for a reader in another process
