"""Cross-memory attach (CMA): host-memory puts and gets between two processes of one machine in
one system call, beside NIXL (used by :mod:`transport.backends.nixl`).

For host memory at both ends and a peer on the same machine, UCX's own ``cma`` transport makes the
same kernel copy (``process_vm_writev``); what NIXL and UCX add around it costs a small put most of
its time (benchmarks/README.md). Here a transfer is prepared once as a ``transport._cma.Transfer``
(csrc/cma.c: the peer's pid, a pidfd, the paired rows) and each post is one call into it.

When it is used, and why it is safe:

* **Only where UCX would copy through the kernel too**: the extension was built, ``$TRANSPORT_CMA``
  is not ``0``, and ``$UCX_TLS`` (when set) allows UCX's ``cma`` transport. A process kept to TCP
  (``UCX_TLS=tcp``, as the hosts tests and a user measuring the network do) never takes it.
* **Only with a peer proven to be on this machine, in this network namespace**: a peer's metadata
  carries an :class:`Identity`: its pid, its network namespace and its gate (a page of shared
  memory, csrc/cma.c) that starts with a random token. The writer opens a pidfd on that pid, maps
  the gate through ``/proc/<pid>/fd``, and reads the token at the gate's address through the
  kernel: matching tokens prove that the pid names the peer's process and that the kernel lets
  this process write to it (same user, ptrace rules). Anything else (another host, another
  namespace, a pid that names another process, a refusal) leaves that peer on NIXL, silently: CMA
  is only a faster way for what NIXL does anyway.
* **Never into memory its owner has closed**: every run counts itself in the peer's gate and
  checks that it is open. A closing Transport shuts its gate before it releases anything, and
  waits for the runs in progress (:meth:`CmaPeers.shut`): a run after that fails as the peer's
  loss, as NIXL's transfers fail once the peer's agent is gone. Each writer counts its runs in a
  slot of its own, keyed by its pid: a writer killed inside a run is not waited for.
* **Never into a process that got the peer's pid**: a run polls the pidfd first (csrc/cma.c)
  unless a poll found the process alive less than a millisecond ago. The kernel gives an exited
  pid to a new process only after its pid counter has gone once around (at least 32,768 process
  creations), which no machine does in a millisecond; the clock runs on while the writer is
  stopped, so the first run after a freeze polls again. A run into an exited process that still
  holds its pid fails with ESRCH: the peer's loss.
* **Bounds**: the rows are those of a plan, checked against the peer's exposed regions before
  they get here (transport/transfers/plan.py); the kernel refuses an unmapped address (EFAULT)
  and the transfer fails with a :class:`~transport.errors.RegionError`, never a crash.

A transfer without a notification is done when its run returns: the bytes are in the peer's
memory, even a stopped peer's. A notified one then writes its last byte again through NIXL with
the notification, and is done when NIXL says so: a notification is sent only after the data, and
a notified put completes, stalls for a frozen peer and fails at its deadline exactly as it does
through NIXL alone (a notification sent on its own would be DONE before it has left the process,
and lost if the process exits then).
"""

from __future__ import annotations

import errno
import functools
import importlib
import logging
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from transport.errors import (
    BackendError,
    PeerLostError,
    RegionError,
    TransportError,
    WireFormatError,
)

log = logging.getLogger(__name__)

#: the environment variable that turns this path off (``0``)
CMA_ENV = "TRANSPORT_CMA"
#: what /proc/<pid>/fd/<n> of a gate links to (csrc/cma.c names its memfd "transport-gate")
GATE_LINK = "/memfd:transport-gate"
#: the first bytes of metadata that carries an Identity
MAGIC = b"TCMA"
VERSION = 2  # 2: the gate counts runs per writer (csrc/cma.c)
TOKEN_BYTES = 16
#: magic, version, pid, gate's memfd, network namespace inode, gate's address, token
_HEADER = struct.Struct(f"<4sB3xIIQQ{TOKEN_BYTES}s")


@dataclass(frozen=True)
class Identity:
    """Who a process is on its machine, as far as CMA is concerned: ``pid``, ``netns`` (the inode
    of its network namespace), ``gate_fd`` (the memfd of its gate: csrc/cma.c) and ``token_at``,
    the address of ``token`` (the head of its gate) in its memory."""

    pid: int
    gate_fd: int
    netns: int
    token_at: int
    token: bytes

    def encode(self) -> bytes:
        return _HEADER.pack(
            MAGIC, VERSION, self.pid, self.gate_fd, self.netns, self.token_at, self.token
        )

    @staticmethod
    def split(metadata: bytes) -> tuple[Identity | None, bytes]:
        """(the Identity at the head of ``metadata``, or None where it has none; the rest). A
        head that starts like one but does not parse is refused with a WireFormatError."""
        if not metadata.startswith(MAGIC):
            return None, metadata
        if len(metadata) < _HEADER.size:
            raise WireFormatError(
                f"a peer's metadata starts with an identity header but has {len(metadata)} bytes, "
                f"fewer than its {_HEADER.size}: it is corrupt or of another version of this "
                "library; the peer must run the same version"
            )
        _, version, pid, gate_fd, netns, token_at, token = _HEADER.unpack_from(metadata)
        if version != VERSION or pid <= 0:
            raise WireFormatError(
                f"a peer's identity header has version {version} and pid {pid}: this library "
                f"reads version {VERSION} with a positive pid; the peer must run the same version"
            )
        return Identity(pid, gate_fd, netns, token_at, token), metadata[_HEADER.size :]


def native() -> ModuleType | None:
    """The compiled extension, or None where it was not built (no C compiler at install time)."""
    try:
        return importlib.import_module("transport._cma")
    except ImportError:
        return None


def refusal(ucx_tls: str | None = None) -> str | None:
    """Why this process does not use CMA (None: it does, with peers that pass the probe)."""
    if os.environ.get(CMA_ENV, "1").strip() == "0":
        return f"${CMA_ENV}=0"
    if native() is None:
        return "the extension transport._cma was not built (no C compiler at install time)"
    tls = os.environ.get("UCX_TLS", "") if ucx_tls is None else ucx_tls
    names = {x.strip().lower() for x in tls.lstrip("^").split(",") if x.strip()}
    kernel_copy = {"all", "sm", "shm", "cma"}
    if tls.strip() and not tls.lstrip().startswith("^") and not names & kernel_copy:
        return f"$UCX_TLS={tls} keeps UCX off the kernel's copy (cma)"
    if tls.lstrip().startswith("^") and names & kernel_copy:
        return f"$UCX_TLS={tls} excludes the kernel's copy (cma)"
    return None


def _netns() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


class CmaPeers:
    """The CMA side of one backend: this process's :class:`Identity` and gate, and the peers
    proven reachable (a ``transport._cma.Process`` each: pid, pidfd and their gate, mapped).

    Rules: it is thread-safe; a peer added again (new metadata) is proven again; a removed peer's
    transfers keep its Process, so a run after it exits fails as the peer's loss and never
    reaches a process that got its pid; :meth:`close` forgets every peer."""

    def __init__(self) -> None:
        self.why_not = refusal()
        self._mod = native() if self.why_not is None else None
        token = secrets.token_bytes(TOKEN_BYTES)
        self._gate: Any = None
        if self._mod is not None:
            try:
                self._gate = self._mod.Gate(token)
            except OSError as e:  # no memfd here: this process takes no CMA transfers
                self.why_not = f"no shared page for the gate ({e})"
                self._mod = None
        gate = self._gate
        self.identity = Identity(
            os.getpid(),
            gate.fd if gate is not None else 0,
            _netns(),
            gate.address if gate is not None else 0,
            token,
        )
        self._lock = threading.Lock()
        self._peers: dict[str, Any] = {}  # agent -> its transport._cma.Process

    def header(self) -> bytes:
        """What goes before this process's NIXL metadata (nothing when CMA is off here)."""
        return self.identity.encode() if self._mod is not None else b""

    def add(self, agent: str, ident: Identity | None) -> bool:
        """Prove ``ident`` (see the module docstring); True when ``agent`` is reachable by CMA."""
        self.remove(agent)
        if self._mod is None or ident is None or ident.netns != self.identity.netns:
            return False
        try:
            # the pidfd first: if the tokens then match, the pidfd holds the token's process
            process = self._mod.Process(ident.pid)
            path = f"/proc/{ident.pid}/fd/{ident.gate_fd}"
            if not os.readlink(path).startswith(GATE_LINK):
                return False  # not a gate (a stale record): never open another kind of file
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                process.attach(fd)
            finally:
                os.close(fd)
            mapped = process.token()
            seen = process.read(ident.token_at, TOKEN_BYTES)
        except (OSError, ValueError, RuntimeError) as e:
            log.debug("CMA with %s: the probe of pid %d failed (%s)", agent, ident.pid, e)
            return False
        if not (mapped == seen == ident.token) or not process.alive():
            return False
        with self._lock:
            self._peers[agent] = process
        return True

    def shut(self, timeout: float) -> bool:
        """No CMA transfer of a peer reaches this process's memory any more: the gate closes,
        and this waits (at most ``timeout`` s) for those in progress. False: some still were."""
        gate = self._gate
        return True if gate is None else bool(gate.shut(float(timeout)))

    def reachable(self, agent: str | None) -> bool:
        return agent is not None and agent in self._peers

    def transfer(
        self, op: str, agent: str, local: np.ndarray, remote: np.ndarray, peer: str
    ) -> CmaTransfer | None:
        """A prepared transfer of paired rows ((address, length, device) each) with ``agent``
        (the peer named ``peer`` in errors), or None when it is not reachable (any more)."""
        with self._lock:
            process = self._peers.get(agent)
        if process is None or self._mod is None:
            return None
        pairs = lambda rows: np.ascontiguousarray(rows[:, :2], dtype=np.uint64)  # noqa: E731
        on_error = functools.partial(cma_error, peer=peer)
        xfer = self._mod.Transfer(process, op == "WRITE", pairs(local), pairs(remote), on_error)
        return CmaTransfer(agent, xfer)

    def remove(self, agent: str) -> None:
        """Forget ``agent``: its transfers hold its process (and pidfd) until they are dropped."""
        with self._lock:
            self._peers.pop(agent, None)

    def close(self) -> None:
        with self._lock:
            self._peers.clear()


class CmaTransfer:
    """One prepared CMA transfer with ``agent``'s process (see :class:`CmaPeers`): ``run()`` moves
    every row, in C, raising the errors of :mod:`transport.errors` (:func:`cma_error`). A
    notified one also holds ``tail``, set by the backend: a transfer of its last byte again that
    carries the notification, so that it completes as the backend's notified transfers do.
    ``calls``: the system calls of one run (rows adjacent on their side merge, csrc/cma.c)."""

    __slots__ = ("agent", "calls", "nbytes", "run", "tail")

    def __init__(self, agent: str, xfer: object) -> None:
        self.agent = agent
        self.run = xfer.run  # type: ignore[attr-defined]
        self.nbytes: int = xfer.nbytes  # type: ignore[attr-defined]
        self.calls: int = xfer.calls  # type: ignore[attr-defined]
        self.tail: Any = None  # the backend's transfer that carries a notification after it


def cma_error(e: OSError, peer: str) -> TransportError:
    """The error of a CMA transfer that the kernel refused, in our tree."""
    moved = getattr(e, "moved", 0)
    if e.errno == errno.ESRCH:
        return PeerLostError(f"peer {peer!r} is gone: its process has exited", peer)
    if e.errno == errno.ECONNRESET:
        return PeerLostError(f"peer {peer!r} closed its Transport: its memory is closed", peer)
    if e.errno == errno.EFAULT:
        return RegionError(
            f"a transfer with peer {peer!r} reached memory that is not mapped any more (after "
            f"{moved} bytes): the peer freed a region it had exposed, or a local tensor was freed "
            "while in flight; keep tensors alive until their handles complete"
        )
    if e.errno == errno.EPERM:
        return BackendError(
            f"the kernel refused a cross-memory transfer with peer {peer!r} (EPERM): the peer "
            f"changed its user or dumpable flag; set {CMA_ENV}=0 to move bytes through NIXL only"
        )
    return BackendError(f"a cross-memory transfer with peer {peer!r} failed: {e}")
