"""Local memory: registrations with the backend, cached per tensor storage.

A tensor's whole storage is registered once, so every view of it can be a
source or destination: tensors that share a storage (a flat buffer and the
parameters viewing it) cost one registration. Where the allocator says which
allocation holds a storage (CUDA's caching allocator: its segments), the
whole allocation is registered once for every tensor in it. Exposed and explicitly registered
tensors stay registered until the Transport closes. Storages registered
implicitly (an unregistered tensor passed to put or get) are kept in an LRU
cache bounded by count and bytes; the cache holds a reference to each storage,
so registered memory can never be freed and reused behind the backend's back,
and an entry is evicted only when no prepared plan uses it.

Registered host memory has a budget (``max_registered_bytes``; RDMA pins what
is registered, so it cannot be swapped): by default three quarters of the
host's physical memory, or ``$TRANSPORT_MAX_REGISTERED_BYTES``. A registration
that would pass it first evicts idle cached ones, then fails with
RegistrationBudgetError, and a call registering many tensors registers all of
them or none.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from transport.backends.base import Backend
from transport.errors import RegistrationBudgetError
from transport.wire import DTYPE_SIZES

log = logging.getLogger(__name__)

_DTYPE_NAMES = {getattr(torch, n): n for n in DTYPE_SIZES if hasattr(torch, n)}


def default_budget() -> int:
    """Host memory a Transport may register: ``$TRANSPORT_MAX_REGISTERED_BYTES``, else three
    quarters of the host's physical memory."""
    env = os.environ.get("TRANSPORT_MAX_REGISTERED_BYTES")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(
                f"TRANSPORT_MAX_REGISTERED_BYTES={env!r} is not a whole number of bytes"
            ) from None
        if value <= 0:
            raise ValueError("TRANSPORT_MAX_REGISTERED_BYTES must be positive")
        return value
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4


#: where a device's allocations lie: sorted (address, bytes), or None to register each storage
Allocations = Callable[[str], "list[tuple[int, int]] | None"]
_MAX_ADDR = 1 << 64


def allocator_segments(device: str) -> list[tuple[int, int]] | None:
    """The CUDA caching allocator's segments on ``device`` (None for host memory, and where the
    allocator may unmap freed parts of a segment: expandable segments). A segment stays mapped
    while any tensor in it is alive, and the registration holds one, so registering the segment
    is safe and serves every tensor in it: a model's parameters cost a few registrations, not
    one each. (Not yet run on a GPU.)"""
    if device == "cpu":
        return None
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return None
    index = int(device.partition(":")[2])
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception as e:  # an allocator without snapshots: register storage by storage
        log.debug("no allocator snapshot on %s: %s", device, e)
        return None
    return sorted(
        (int(s["address"]), int(s["total_size"]))
        for s in segments
        if s.get("device") == index and s.get("total_size")
    )


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} is not supported for transfers; supported: {', '.join(DTYPE_SIZES)}"
        ) from None


def device_of(t: torch.Tensor) -> str:
    if t.is_cpu:  # a tenth of the cost of asking its device (models of 100,000 tensors ask often)
        return "cpu"
    kind = t.device.type
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        return (
            f"cuda:{t.device.index if t.device.index is not None else torch.cuda.current_device()}"
        )
    raise ValueError(
        f"tensor is on device {t.device}; only CPU and CUDA tensors can be transferred"
    )


def check_tensor(t: object, what: str = "tensor") -> torch.Tensor:
    """The checks every source or destination passes before any byte moves."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(
            f"{what} has layout {t.layout}; only dense (strided) tensors can be transferred"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"{what} is not contiguous; call .contiguous() or register a contiguous buffer"
        )
    if not t.is_cpu:
        device_of(t)
    if t.dtype not in _DTYPE_NAMES:
        dtype_name(t.dtype)
    return t


class Registration:
    """One backend registration: the whole memory of one tensor storage (``base``, ``nbytes``)
    on one ``device``, and the backend's ``token`` for it.

    It holds the ``storage`` while registered, so the memory cannot be freed and reused behind
    the backend's back (None once deregistered). ``users`` counts the plans holding it: eviction
    skips it while that is not 0. ``explicit`` (exposed or registered by the user) means it is
    never evicted; ``LocalMemory.release_explicit`` turns it back into an ordinary cached one.
    """

    __slots__ = ("base", "device", "explicit", "nbytes", "storage", "token", "users")

    def __init__(
        self, base: int, nbytes: int, device: str, token: Any, storage: Any, explicit: bool
    ) -> None:
        self.base = base
        self.nbytes = nbytes
        self.device = device
        self.token = token
        self.storage = storage  # keeps the memory alive while registered
        self.explicit = explicit
        self.users = 0


class LocalMemory:
    """The registrations of one agent (a Transport's or a lane's), one per storage or per
    allocation holding storages (``allocations``; keyed by start address and device), with an LRU
    bound on the implicit ones (``max_implicit``, ``max_implicit_bytes``).

    Host memory registered in all stays within ``budget`` (see the module docstring).
    ``lock`` guards the registrations (regions, the plan cache and a lane cutting a transfer use it
    from their own threads); :meth:`close` runs once every engine has stopped. A storage is
    registered once, and again only if it grew. :meth:`acquire` counts a plan as a user of the
    registration in the same step, so no eviction or withdrawal can drop it in between. Implicit
    entries are evicted oldest first but never while a plan holds one, so the cache can stay over
    its bounds until plans let go (the Transport sheds idle ones for that, and :meth:`evict`
    looks again); a registration scans the cache only when the cache is over a bound, and after
    a scan that freed nothing, only once the cache has grown by a quarter (so a plan of 100,000
    tensors costs no quadratic time); explicit ones stay until ``release_explicit`` or
    :meth:`close`, which deregisters everything.
    """

    def __init__(
        self,
        backend: Backend,
        max_implicit: int = 1024,
        max_implicit_bytes: int = 4 << 30,
        budget: int | None = None,
        allocations: Allocations | None = None,
    ) -> None:
        self._backend = backend
        self._regs: OrderedDict[tuple[int, str], Registration] = OrderedDict()
        self.max_implicit = max_implicit
        self.max_implicit_bytes = max_implicit_bytes
        self.budget = default_budget() if budget is None else budget
        self._total_bytes = 0  # of every registration, explicit or not
        self._host_bytes = 0  # of the registrations of host memory (what the budget bounds)
        self._next_scan: int | None = None  # after a fruitless scan: scan at this many again
        self._allocations = allocations or (lambda device: allocator_segments(device))
        # per device, the (start, end) of registrations made for an allocation holding storages
        self._spanned: dict[str, list[tuple[int, int]]] = {}
        self.lock = threading.RLock()

    def acquire(self, t: torch.Tensor) -> Registration:
        """The registration under ``t`` (made if needed), with one more user (a plan's)."""
        with self.lock:
            reg = self.ensure(t)
            reg.users += 1
            return reg

    def acquire_all(self, tensors: Sequence[torch.Tensor]) -> tuple[Registration, ...]:
        """:meth:`acquire` for the registration under each distinct storage of ``tensors``
        (the views of one flat buffer: one)."""
        out: dict[int, Registration] = {}
        with self.lock:
            for t in tensors:
                st = t.untyped_storage().data_ptr()
                if st not in out:
                    out[st] = self.acquire(t)
        return tuple(out.values())

    def ensure(self, t: torch.Tensor, explicit: bool = False) -> Registration:
        with self.lock:
            return self._ensure(t, explicit)

    def _ensure(self, t: torch.Tensor, explicit: bool) -> Registration:
        storage = t.untyped_storage()
        base, nbytes, device = storage.data_ptr(), storage.nbytes(), device_of(t)
        reg = self._find(base, nbytes, device)
        if reg is not None:
            self._regs.move_to_end((reg.base, device))
            reg.explicit = reg.explicit or explicit
            return reg
        start, size = self._span(base, nbytes, device, {})
        key = (start, device)
        self._make_room({key: (size, device)}, "a tensor")
        old = self._regs.get(key)
        if old is not None:  # the storage grew in place: register it again
            self._drop(key, old)
        token = self._backend.register(start, max(size, 1), device)
        reg = Registration(start, size, device, token, storage, explicit)
        self._add(key, reg, spanned=(start, size) != (base, nbytes))
        if not explicit:
            self._evict(reg)
        return reg

    def ensure_all(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[Registration]:
        """Register the memory under ``named`` (explicitly: exposed or registered by the user),
        all or none: past the budget nothing is registered (RegistrationBudgetError), and a
        backend error drops what this call registered before it is raised. Returns the
        registration under each tensor, in order."""
        with self.lock:
            new: dict[tuple[int, str], tuple[int, str]] = {}
            storages: dict[tuple[int, str], tuple[Any, bool]] = {}
            spans: dict[str, list[tuple[int, int]] | None] = {}  # one look per device and call
            under: dict[tuple[int, str], tuple[int, str]] = {}  # storage -> registration key
            keys: list[tuple[int, str]] = []
            first = ""
            for name, t in named:
                st = t.untyped_storage()
                base, device = st.data_ptr(), device_of(t)
                skey = (base, device)
                key = under.get(skey)
                if key is None:
                    nbytes = st.nbytes()
                    reg = self._find(base, nbytes, device)
                    if reg is not None:
                        key = (reg.base, device)
                    else:
                        start, size = self._span(base, nbytes, device, spans)
                        key = (start, device)
                        if size > new.get(key, (0, ""))[0]:
                            new[key] = (size, device)
                            storages[key] = (st, (start, size) != (base, nbytes))
                            first = first or name
                    under[skey] = key
                keys.append(key)
            self._make_room(new, f"{len(named)} tensors (the first new one {first!r})")
            made: list[tuple[int, str]] = []
            try:
                for key, (size, device) in new.items():
                    old = self._regs.get(key)
                    if old is not None:
                        self._drop(key, old)
                    token = self._backend.register(key[0], max(size, 1), device)
                    st, spanned = storages[key]
                    self._add(key, Registration(key[0], size, device, token, st, True), spanned)
                    made.append(key)
            except BaseException:
                for key in made:
                    self._drop(key, self._regs[key])
                raise
            for key in set(keys):
                self._regs[key].explicit = True
                self._regs.move_to_end(key)
            return [self._regs[k] for k in keys]

    def registration_of(self, t: torch.Tensor) -> Registration | None:
        """The registration whose memory holds all of ``t``'s storage, if there is one."""
        st = t.untyped_storage()
        with self.lock:
            return self._find(st.data_ptr(), st.nbytes(), device_of(t))

    def _find(self, base: int, nbytes: int, device: str) -> Registration | None:
        """The registration of this storage, or of an allocation that holds it."""
        reg = self._regs.get((base, device))
        if reg is not None and reg.nbytes >= nbytes:
            return reg
        spans = self._spanned.get(device)
        if spans:
            i = bisect.bisect_right(spans, (base, _MAX_ADDR)) - 1
            if i >= 0 and base + nbytes <= spans[i][1]:
                return self._regs[(spans[i][0], device)]
        return None

    def _span(
        self, base: int, nbytes: int, device: str, looked: dict[str, list[tuple[int, int]] | None]
    ) -> tuple[int, int]:
        """What to register for a storage: the allocation that holds it, where the allocator
        says (``allocations``; looked up once per device in ``looked``), else the storage."""
        if device not in looked:
            looked[device] = self._allocations(device)
        spans = looked[device]
        if spans:
            i = bisect.bisect_right(spans, (base, _MAX_ADDR)) - 1
            if i >= 0 and base + nbytes <= spans[i][0] + spans[i][1]:
                return spans[i]
        return base, nbytes

    def _add(self, key: tuple[int, str], reg: Registration, spanned: bool = False) -> None:
        self._regs[key] = reg
        self._total_bytes += reg.nbytes
        if reg.device == "cpu":
            self._host_bytes += reg.nbytes
        if spanned:
            bisect.insort(
                self._spanned.setdefault(reg.device, []), (reg.base, reg.base + reg.nbytes)
            )

    def _make_room(self, new: dict[tuple[int, str], tuple[int, str]], what: str) -> None:
        """Raise RegistrationBudgetError unless registering ``new`` (key -> (bytes, device)) keeps
        host memory within the budget, after evicting idle cached registrations if needed."""
        extra = 0
        for key, (nbytes, device) in new.items():
            if device == "cpu":
                old = self._regs.get(key)
                extra += nbytes - (old.nbytes if old is not None else 0)
        if self._host_bytes + extra <= self.budget:
            return
        for key, reg in list(self._regs.items()):  # oldest first
            if self._host_bytes + extra <= self.budget:
                return
            if not reg.explicit and reg.users == 0 and reg.device == "cpu" and key not in new:
                self._drop(key, reg)
        if self._host_bytes + extra > self.budget:
            raise RegistrationBudgetError(
                f"registering {what} needs {extra} more bytes of host memory; with the "
                f"{self._host_bytes} bytes this agent has registered that passes its budget of "
                f"{self.budget} bytes (registered host memory is pinned by RDMA). Register fewer "
                "or smaller buffers (views into one buffer share one registration), unexpose what "
                "is no longer used, or raise the budget: Transport(max_registered_bytes=...) or "
                "$TRANSPORT_MAX_REGISTERED_BYTES. Nothing of this call was registered"
            )

    def over_limit(self) -> bool:
        with self.lock:
            implicit = [r for r in self._regs.values() if not r.explicit]
        return (
            len(implicit) > self.max_implicit
            or sum(r.nbytes for r in implicit) > self.max_implicit_bytes
        )

    def evict(self, keep: Registration | None = None) -> None:
        """Deregister the oldest implicit registrations no plan uses until under the limits
        (never ``keep``, the one being used right now). Each holds its memory alive, so this is
        what lets the memory of tensors put once and dropped be freed."""
        with self.lock:
            self._next_scan = None  # plans may have let go since: look now
            self._evict(keep)

    def _evict(self, keep: Registration | None) -> None:
        if len(self._regs) <= self.max_implicit and not self._over_bytes():
            return  # under both limits whatever is explicit: no scan (a model has 100,000 tensors)
        if self._next_scan is not None and len(self._regs) < self._next_scan:
            return  # the last scan found nothing to evict: scan again after a quarter more
        implicit = [(k, r) for k, r in self._regs.items() if not r.explicit and r is not keep]
        count = len(implicit) + (keep is not None and not keep.explicit)
        total = sum(r.nbytes for _, r in implicit) + (keep.nbytes if keep is not None else 0)
        for key, reg in implicit:  # oldest first
            if count <= self.max_implicit and total <= self.max_implicit_bytes:
                break
            if reg.users == 0:
                self._drop(key, reg)
                count -= 1
                total -= reg.nbytes
        over = count > self.max_implicit or total > self.max_implicit_bytes
        self._next_scan = len(self._regs) + max(64, len(self._regs) // 4) if over else None

    def _over_bytes(self) -> bool:
        """Whether every registration together (explicit too) passes the bytes limit: a bound
        above the implicit ones' bytes, kept up to date without a scan."""
        return self._total_bytes > self.max_implicit_bytes

    def release_explicit(self, t: torch.Tensor, still_used: list[torch.Tensor]) -> None:
        """``t`` is no longer exposed: its registration becomes an ordinary cached one (dropped
        now if no plan uses it), unless another exposed tensor shares its storage."""
        with self.lock:
            self._release_explicit(t, still_used)

    def _release_explicit(self, t: torch.Tensor, still_used: list[torch.Tensor]) -> None:
        reg = self.registration_of(t)
        if reg is None:
            return
        for x in still_used:
            if self.registration_of(x) is reg:
                return
        reg.explicit = False
        if reg.users == 0:
            self._drop((reg.base, reg.device), reg)

    def _drop(self, key: tuple[int, str], reg: Registration) -> None:
        del self._regs[key]
        spans = self._spanned.get(reg.device)
        if spans and (reg.base, reg.base + reg.nbytes) in spans:
            spans.remove((reg.base, reg.base + reg.nbytes))
        self._total_bytes -= reg.nbytes
        if reg.device == "cpu":
            self._host_bytes -= reg.nbytes
        try:
            self._backend.deregister(reg.token)
        except Exception as e:
            log.warning("deregistering %d bytes at 0x%x failed: %s", reg.nbytes, reg.base, e)
        reg.storage = None

    def close(self) -> None:
        """Deregister everything, in one call to the backend (one by one is quadratic in NIXL)."""
        with self.lock:
            regs = list(self._regs.values())
            self._regs.clear()
            self._spanned.clear()
            self._total_bytes = self._host_bytes = 0
        try:
            self._backend.deregister_many([(r.token, r.base, r.nbytes, r.device) for r in regs])
        except Exception as e:
            log.warning("deregistering %d registrations failed: %s", len(regs), e)
        for reg in regs:  # the memory may be freed now, not before
            reg.storage = None

    def __len__(self) -> int:
        return len(self._regs)
