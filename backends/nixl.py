"""The NIXL backend: one NIXL agent over UCX.

How NIXL 1.5 is driven here, and why:

* Incoming transfers need the receiver's progress (over TCP nothing lands without it). With
  ``progress="events"`` NIXL's progress thread makes it: it sleeps in ``poll()`` on UCX's event
  file descriptor and wakes when traffic arrives, so an idle receiver costs no CPU and a small
  write lands in about one network round trip instead of at the receiver's next poll. NIXL's
  Python wrapper hard-codes that thread's poll timeout to 0, which turns it into a spin on a
  whole core: the agent is built here from NIXL's bindings with a timeout of ``WAKE_MS`` (a
  safety wake-up only). With ``progress="poll"`` the thread is off and the Transport's engine
  makes all progress in its own polls (``get_notifs``, transfer polls). The thread costs a
  writer bulk bandwidth through shared memory (its polls and the thread contend for UCX's
  worker: half the bandwidth of a large same-host put, benchmarks/README.md), so ``auto`` (the
  default) takes events only where UCX is kept to network transports (``UCX_TLS`` names no
  shared-memory one), where a receiver's wake-up is what a small message waits for.
* The agent runs in ``NIXL_THREAD_SYNC_STRICT`` mode: the caller's thread posts
  small transfers while the engine thread polls; one agent used from two
  threads without it crashed or hung.
* NIXL logs INFO to stdout and switches ``logging.raiseExceptions`` off for the
  whole process on import; both are undone here (NIXL_LOG_LEVEL=WARN, and
  UCX_LOG_LEVEL=fatal since UCX's errors reach the user as our exceptions,
  unless the user set them).
* On a machine with the verbs library (libibverbs) but no RDMA device, UCX's ib
  module makes every process crash as it exits; there ``UCX_MODULES=^ib`` is
  set unless the user set it.
* UCX patches the process's ``mmap``/``munmap`` functions when its first context starts, so
  that its registration cache hears of memory going away. That patching costs about 0.4 s of
  CPU in a process that has loaded torch (15 times the rest of an agent's start), and buys
  nothing here: NIXL registers every region explicitly and keeps the registration until it
  is deregistered, so the cache never serves a stale one. ``UCX_MEM_MMAP_HOOK_MODE=none`` is
  set unless the user set it: UCX then runs without its registration cache (its supported
  configuration for processes it cannot patch, such as sanitizer builds).
* UCX's TCP transport connects with a blocking ``connect()`` unless ``UCX_TCP_CONN_NB=y``: the
  first contact with a peer whose link is down held the connecting thread until the kernel gave
  up (3 s for an address nobody answers for, 38 s for a peer that restarted behind a cut link,
  where the old neighbour entry keeps the SYNs going out), whatever deadline the caller had.
  Non-blocking, loading the peer returns at once and the first transfer to it fails at its
  own deadline, as every other fault of a peer does; ``UCX_TCP_CONN_NB=y`` is set unless the
  user set it.
* Host memory at both ends with a peer of the same machine moves by cross-memory attach, one
  system call per post (:mod:`transport.backends.cma`: when, and why it is safe), where UCX
  would make the same kernel copy below NIXL's layers; everything else goes through NIXL.
* NIXL reports failures as many exception types and as status codes; all of
  them become errors of :mod:`transport.errors` in :func:`map_nixl_error`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from transport.backends.base import DONE, IN_PROGRESS, Backend, device_parts
from transport.backends.cma import CmaPeers, CmaTransfer, Identity
from transport.errors import BackendError, PeerLostError, RegionError, TransportError

log = logging.getLogger(__name__)

#: how an agent makes progress for incoming transfers (see the module docstring)
PROGRESS_MODES = ("auto", "events", "poll")
#: UCX transports (or aliases) that move bytes through shared memory on one host
SHARED_MEMORY_TLS = frozenset({"all", "sm", "shm", "cma", "posix", "sysv", "xpmem", "knem", "mm"})
#: the environment variable that chooses it where the code does not
PROGRESS_ENV = "TRANSPORT_PROGRESS"
#: the longest the progress thread sleeps without traffic (UCX may miss a wake-up: this bounds it)
WAKE_MS = 1000

_lock = threading.Lock()
_mods: tuple[ModuleType, ModuleType] | None = None

#: NIXL exception class name -> (our error class, what it means)
NIXL_ERRORS: dict[str, tuple[type[TransportError], str]] = {
    "nixlRemoteDisconnectError": (PeerLostError, "the peer disconnected"),
    "nixlNotFoundError": (BackendError, "NIXL does not know the agent or memory"),
    "nixlBackendError": (BackendError, "the UCX backend failed"),
    "nixlCancelledError": (BackendError, "the transfer was cancelled"),
    "nixlInvalidParamError": (BackendError, "NIXL rejected a parameter"),
    "nixlMismatchError": (RegionError, "descriptor lists do not match"),
    "nixlNoTelemetryError": (BackendError, "telemetry is off"),
    "nixlNotAllowedError": (BackendError, "NIXL does not allow this now"),
    "nixlNotPostedError": (BackendError, "the transfer was not posted"),
    "nixlNotSupportedError": (BackendError, "NIXL does not support this"),
    "nixlRepostActiveError": (BackendError, "the transfer is still in progress"),
    "nixlUnknownError": (BackendError, "NIXL failed for an unknown reason"),
}


def map_nixl_error(
    exc: BaseException,
    *,
    action: str,
    peer: str | None = None,
    not_found: type[TransportError] | None = None,
) -> TransportError:
    """Turn a NIXL exception into our tree. ``not_found`` overrides the class of nixlNotFoundError,
    whose meaning depends on the call (an unknown peer, or memory outside a registration)."""
    name = type(exc).__name__
    cls, meaning = NIXL_ERRORS.get(name, (BackendError, "NIXL failed"))
    if name == "nixlNotFoundError" and not_found is not None:
        cls = not_found
    who = f" (peer {peer!r})" if peer else ""
    msg = f"{action} failed{who}: {meaning} [{name}: {exc}]"
    err = cls(msg, peer) if cls in (PeerLostError,) else cls(msg)
    err.__cause__ = exc
    return err


def _rdma_devices() -> bool:
    """Whether this machine has an RDMA device (InfiniBand, RoCE) that UCX could use."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def load_nixl() -> tuple[ModuleType, ModuleType]:
    """Import NIXL's Python API quietly: (the _api module, the _bindings module)."""
    global _mods
    with _lock:
        if _mods is not None:
            return _mods
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        os.environ.setdefault("UCX_LOG_LEVEL", "fatal")  # UCX errors surface as our exceptions
        os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")  # see the module docstring
        os.environ.setdefault("UCX_TCP_CONN_NB", "y")  # no connect() blocks past a deadline
        if not _rdma_devices():
            # with the verbs library installed but no RDMA device, UCX's ib module crashes the
            # process as it exits (SIGSEGV after a clean run); without devices it has no use
            os.environ.setdefault("UCX_MODULES", "^ib")
        candidates = (
            [os.environ["TRANSPORT_NIXL_MODULE"]]
            if os.environ.get("TRANSPORT_NIXL_MODULE")
            else [
                "nixl",
                "nixl_cu13",
                "nixl_cu12",
            ]
        )
        saved = logging.raiseExceptions
        errors = []
        try:
            for name in candidates:
                try:
                    importlib.import_module(name)
                    api = importlib.import_module(f"{name}._api")
                    bindings = importlib.import_module(f"{name}._bindings")
                except ImportError as e:
                    errors.append(f"{name}: {e}")
                    continue
                _mods = (api, bindings)
                return _mods
        finally:
            logging.raiseExceptions = saved  # NIXL turns it off for the whole process
        raise BackendError(
            "NIXL is not installed or failed to import (" + "; ".join(errors) + "); "
            "install it with: pip install nixl-cu13   (or nixl-cu12 on CUDA 12 machines)"
        )


def installed() -> bool:
    """Whether a NIXL module is there to import (found, not imported: that costs a second)."""
    names = [os.environ.get("TRANSPORT_NIXL_MODULE") or "", "nixl", "nixl_cu13", "nixl_cu12"]
    for name in filter(None, names):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def progress_mode(progress: str | None, ucx_tls: str | None = None) -> str:
    """``events`` or ``poll``: ``progress``, else ``$TRANSPORT_PROGRESS``, else ``auto``, which is
    ``events`` where ``ucx_tls`` (default ``$UCX_TLS``) keeps UCX to network transports and
    ``poll`` elsewhere. Anything else is refused, naming the choices."""
    mode = progress if progress is not None else os.environ.get(PROGRESS_ENV) or "auto"
    if mode not in PROGRESS_MODES:
        where = "progress" if progress is not None else f"${PROGRESS_ENV}"
        raise ValueError(
            f"{where} must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}: 'events' wakes "
            "a receiver on traffic (for peers across a network), 'poll' makes progress only in "
            "the engine's polls (best for bulk through shared memory), 'auto' picks by $UCX_TLS"
        )
    if mode != "auto":
        return mode
    tls = os.environ.get("UCX_TLS", "") if ucx_tls is None else ucx_tls
    names = {x.strip().lower() for x in tls.split(",") if x.strip()}
    if not names or tls.lstrip().startswith("^") or names & SHARED_MEMORY_TLS:
        return "poll"
    return "events"


def nixl_exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class NIXL's bindings define (for the mapping test)."""
    _, b = load_nixl()
    return {
        n: getattr(b, n)
        for n in dir(b)
        if isinstance(getattr(b, n), type) and issubclass(getattr(b, n), BaseException)
    }


@dataclass(frozen=True)
class Prepped:
    """A prepared descriptor list: NIXL's handle, the rows it was made of (for CMA transfers),
    whose they are (None: this agent's) and their memory kind."""

    handle: Any
    rows: np.ndarray
    agent: str | None
    mem: str


class NixlBackend(Backend):
    """One NIXL agent (UCX) with strict thread synchronisation. It owns the agent and, with
    ``progress`` ``events``, its progress thread (see the module docstring): closing it destroys
    both. Rules: ``progress`` is ``auto``, ``events`` or ``poll`` (default:
    ``$TRANSPORT_PROGRESS``, else ``auto``), fixed at construction; :attr:`progress` says which
    one ``auto`` chose."""

    name = "nixl"

    def __init__(self, agent_name: str, num_threads: int = 0, progress: str | None = None) -> None:
        api, b = load_nixl()
        self._b = b
        self.agent_name = agent_name
        self.progress = progress_mode(progress)
        cfg = b.nixlAgentConfig()
        cfg.useProgThread = self.progress == "events"
        cfg.pthrDelay = WAKE_MS * 1000  # microseconds; NIXL's thread rounds it up to whole ms
        cfg.useListenThread = False
        cfg.syncMode = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
        try:
            self._raw = b.nixlAgent(agent_name, cfg)  # the C++ agent, without NIXL's wrapper
            if "UCX" not in self._raw.getAvailPlugins():
                raise BackendError("NIXL has no UCX plugin; reinstall nixl-cu13 (or nixl-cu12)")
            init = {"num_threads": str(num_threads)} if num_threads > 0 else {}
            self._ucx = self._raw.createBackend("UCX", init)
        except TransportError:
            raise
        except Exception as e:
            raise map_nixl_error(e, action="creating the NIXL agent") from e
        self._mem = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
        self._ops = {"READ": b.NIXL_READ, "WRITE": b.NIXL_WRITE}
        self._success = b.NIXL_SUCCESS
        self._in_prog = b.NIXL_IN_PROG
        self._closed = False
        self.cma = CmaPeers()  # host transfers with peers of this machine (see cma.py)

    # -- setup ---------------------------------------------------------------------------------

    def metadata(self, memory: Sequence[tuple[int, int, str]] = ()) -> bytes:
        """NIXL's partial metadata: the connection and only ``memory``'s descriptors. Full
        metadata grows with every registration, so a trainer that registers
        100,000 separately allocated parameters to send them would publish megabytes that no
        peer uses. Exposed memory on host and GPU at once takes the full metadata (NIXL's partial
        metadata takes one memory kind)."""
        kinds = {device_parts(dev)[0] for _, _, dev in memory}
        if len(kinds) > 1:
            md: bytes = self._raw.getLocalMD()
            return self.cma.header() + md
        mem = kinds.pop() if kinds else "DRAM"
        descs = self._b.nixlRegDList(
            self._mem[mem], [(addr, n, device_parts(dev)[1], "") for addr, n, dev in memory]
        )
        try:
            md = self._raw.getLocalPartialMD(descs, True, [self._ucx])
        except Exception as e:
            raise map_nixl_error(e, action="describing this agent's exposed memory") from e
        return self.cma.header() + md

    def register(self, addr: int, nbytes: int, device: str) -> Any:
        mem, dev = device_parts(device)
        descs = self._b.nixlRegDList(self._mem[mem], [(addr, nbytes, dev, "")])
        try:
            self._raw.registerMem(descs, [])
        except Exception as e:
            raise map_nixl_error(e, action=f"registering {nbytes} bytes of {device} memory") from e
        return descs

    def deregister(self, token: Any) -> None:
        try:
            self._raw.deregisterMem(token, [])
        except Exception as e:
            raise map_nixl_error(e, action="deregistering memory") from e

    def deregister_many(self, registrations: Sequence[tuple[Any, int, int, str]]) -> None:
        """One call per memory kind: NIXL looks each registration up in a list, so deregistering
        them one by one costs time quadratic in their number (benchmarks/README.md)."""
        kinds: dict[str, list[tuple[int, int, int, str]]] = {}
        for _, addr, n, device in registrations:
            mem, dev = device_parts(device)
            kinds.setdefault(mem, []).append((addr, n, dev, ""))
        for mem, descs in kinds.items():
            try:
                self._raw.deregisterMem(self._b.nixlRegDList(self._mem[mem], descs), [])
            except Exception as e:  # one at a time, then: what can go, goes
                log.debug("deregistering %d %s registrations at once: %s", len(descs), mem, e)
                for token, _, _, device in registrations:
                    if device_parts(device)[0] == mem:
                        try:
                            self.deregister(token)
                        except TransportError as e2:
                            log.warning("%s", e2)

    def add_peer(self, metadata: bytes) -> str:
        ident, metadata = Identity.split(metadata)
        try:
            name = self._raw.loadRemoteMD(metadata)
        except Exception as e:
            raise map_nixl_error(e, action="loading a peer's metadata") from e
        agent = name.decode() if isinstance(name, bytes) else str(name)
        self.cma.add(agent, ident)
        return agent

    def kernel_copies(self, agent: str) -> bool:
        return self.cma.reachable(agent)

    def remove_peer(self, agent: str) -> None:
        self.cma.remove(agent)
        try:
            self._raw.invalidateRemoteMD(agent)
        except Exception as e:  # unknown or already gone: nothing left to forget
            log.debug("removing agent %s: %s", agent, e)

    def prep(self, agent: str | None, descs: np.ndarray, device: str) -> Any:
        mem, _ = device_parts(device)
        dl = self._b.nixlXferDList(self._mem[mem], descs)
        target = self._b.NIXL_INIT_AGENT if agent is None else agent
        try:
            return Prepped(self._raw.prepXferDlist(target, dl, []), descs, agent, mem)
        except Exception as e:
            side = "local" if agent is None else f"agent {agent!r}"
            raise map_nixl_error(
                e,
                action=f"preparing {len(descs)} {side} descriptors",
                not_found=RegionError if agent is None else PeerLostError,
            ) from e

    def release_prepped(self, prepped: Any) -> None:
        try:
            self._raw.releasedDlistH(prepped.handle)
        except Exception as e:
            log.debug("releasing a descriptor list: %s", e)

    # -- transfers -----------------------------------------------------------------------------

    def make_xfer(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        notif: bytes,
        peer: str,
    ) -> Any:
        rows = self._cma_rows(local, local_idx, remote, remote_idx)
        if rows is not None:
            xfer = self.cma.transfer(op, remote.agent, *rows, peer)
            if xfer is not None:
                if notif:
                    xfer.tail = self._tail(op, remote.agent, rows, notif, peer)
                return xfer
        return self._nixl_xfer(op, local, local_idx, remote, remote_idx, notif, peer)

    def direct(
        self,
        op: str,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        peer: str,
    ) -> Callable[[], None] | None:
        """A CMA transfer (cma.py) where both lists are host memory and the peer is reachable."""
        rows = self._cma_rows(local, local_idx, remote, remote_idx)
        xfer = None if rows is None else self.cma.transfer(op, remote.agent, *rows, peer)
        return None if xfer is None else xfer.run

    def _cma_rows(
        self, local: Prepped, local_idx: np.ndarray, remote: Prepped, remote_idx: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The paired rows of a CMA transfer between the two lists, or None where CMA does not
        take them (device memory, or a peer not proven: cma.py)."""
        if local.mem == remote.mem == "DRAM" and self.cma.reachable(remote.agent):
            return local.rows[local_idx], remote.rows[remote_idx]
        return None

    def _nixl_xfer(
        self,
        op: str,
        local: Prepped,
        local_idx: np.ndarray,
        remote: Prepped,
        remote_idx: np.ndarray,
        notif: bytes,
        peer: str,
    ) -> Any:
        try:
            return self._raw.makeXferReq(
                self._ops[op], local.handle, local_idx, remote.handle, remote_idx, notif, [], False
            )
        except Exception as e:
            raise map_nixl_error(
                e, action=f"preparing a {op}", peer=peer, not_found=PeerLostError
            ) from e

    def _tail(
        self, op: str, agent: str, rows: tuple[np.ndarray, np.ndarray], notif: bytes, peer: str
    ) -> tuple[Any, Prepped, Prepped]:
        """The NIXL transfer of a CMA transfer's last byte again, with ``notif``: (transfer, local
        list, remote list)."""
        last = [np.array([[r[-1, 0] + r[-1, 1] - 1, 1, r[-1, 2]]], dtype=np.uint64) for r in rows]
        local = self.prep(None, last[0], "cpu")
        try:
            remote = self.prep(agent, last[1], "cpu")
        except BaseException:
            self.release_prepped(local)
            raise
        one = np.zeros(1, dtype=np.int32)
        try:
            return self._nixl_xfer(op, local, one, remote, one, notif, peer), local, remote
        except BaseException:
            self.release_prepped(local)
            self.release_prepped(remote)
            raise

    def post(self, xfer: Any, notif: bytes, peer: str) -> int:
        if xfer.__class__ is CmaTransfer:
            xfer.run()  # our errors (cma.py)
            if not notif:
                return DONE
            if xfer.tail is None:
                raise BackendError(
                    f"a transfer to peer {peer!r} made without a notification was posted with one"
                )
            xfer = xfer.tail[0]  # the last byte again, with the notification (cma.py)
        try:
            st = self._raw.postXferReq(xfer, notif)
        except Exception as e:
            raise map_nixl_error(
                e, action="posting a transfer", peer=peer, not_found=PeerLostError
            ) from e
        if st == self._success:
            return DONE
        if st == self._in_prog:
            return IN_PROGRESS
        raise BackendError(f"posting a transfer to peer {peer!r} failed with NIXL status {st}")

    def poll(self, xfer: Any, peer: str) -> int:
        if xfer.__class__ is CmaTransfer:
            if xfer.tail is None:
                return DONE  # done inside its post
            xfer = xfer.tail[0]
        try:
            st = self._raw.getXferStatus(xfer)
        except Exception as e:
            raise map_nixl_error(e, action="a transfer", peer=peer, not_found=PeerLostError) from e
        if st == self._success:
            return DONE
        if st == self._in_prog:
            return IN_PROGRESS
        raise PeerLostError(f"a transfer to peer {peer!r} failed with NIXL status {st}", peer)

    def release_xfer(self, xfer: Any) -> bool:
        if xfer.__class__ is CmaTransfer:
            if xfer.tail is None:
                return True  # nothing of NIXL's; its process goes with its last transfer
            tail, local, remote = xfer.tail
            if not self.release_xfer(tail):
                return False  # still NIXL's: its lists stay until it is released
            xfer.tail = None
            self.release_prepped(local)
            self.release_prepped(remote)
            return True
        try:
            self._raw.releaseXferReq(xfer)
        except Exception as e:
            log.debug("releasing a transfer: %s", e)
            return False
        return True

    def get_notifs(self) -> dict[str, list[bytes]]:
        try:
            notifs: dict[str, list[bytes]] = self._raw.getNotifs({}, [])
        except Exception as e:
            raise map_nixl_error(e, action="reading notifications") from e
        return notifs

    def send_notif(self, agent: str, message: bytes, peer: str) -> None:
        try:
            self._raw.genNotif(agent, message)
        except Exception as e:
            raise map_nixl_error(
                e, action="sending a notification", peer=peer, not_found=PeerLostError
            ) from e

    def refuse_incoming(self, timeout: float) -> bool:
        """Shut the CMA gate (cma.py): NIXL's own transfers fail once the agent is destroyed."""
        if self.cma.shut(timeout):
            return True
        log.warning("%s: a peer's transfer into this memory still ran at close", self.agent_name)
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.cma.shut(0.0)
        self.cma.close()
        # Dropping the agent destroys it (its destructor joins its progress thread and
        # disconnects from peers); the handle of its UCX backend goes first, as it points into it.
        self._ucx = None
        self._raw = None
