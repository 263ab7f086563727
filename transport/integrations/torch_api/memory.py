"""Registered memory as torch's transport API sees it: a registration, its views, its handle.

A registration is one tensor's bytes, exposed by the endpoint's engine as a region of its own
(readable and writable by the peers it is described to). Views are byte ranges of it: a
:class:`MemoryView` is what a write sends from, a :class:`MutableMemoryView` (the only kind
with ``writable``) what a read lands in.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    from transport.integrations.torch_api.descriptors import RemoteRegion


@dataclass(eq=False)
class Registration:
    """One tensor registered by one endpoint: its bytes (``data``, a flat ``uint8`` view of the
    tensor), the region the engine exposes them as, and whether it is still registered.
    Aliases (the same tensor registered again) share it, and so share its lifetime."""

    tensor: torch.Tensor
    data: torch.Tensor
    region: str
    address: int = field(init=False)
    length: int = field(init=False)
    active: bool = True

    def __post_init__(self) -> None:
        self.address = self.data.data_ptr()
        self.length = self.data.numel()

    def check(self) -> None:
        """Raise unless it is still registered and its tensor still holds the same memory."""
        if not self.active:
            raise RuntimeError(
                "this memory was unregistered (or its endpoint closed): register the tensor "
                "again and hand the peer a fresh descriptor"
            )
        if self.tensor.data_ptr() != self.address or self.tensor.nbytes != self.length:
            raise RuntimeError(
                "the registered tensor was resized or its storage replaced; registered memory "
                "must keep its storage: unregister it and register the new one"
            )


class MemoryView:
    """``length`` bytes at ``offset`` of a registration: what a write sends."""

    __slots__ = ("_data", "length", "offset", "registration")

    def __init__(self, registration: Registration, offset: int, length: int) -> None:
        self.registration = registration
        self.offset = offset
        self.length = length
        self._data: torch.Tensor | None = None

    def size(self) -> int:
        return self.length

    def bytes(self) -> torch.Tensor:
        """The bytes this view covers (a view of the registered tensor, made once)."""
        if self._data is None:
            self._data = self.registration.data[self.offset : self.offset + self.length]
        return self._data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.registration.region}, {self.offset}+{self.length})"


class MutableMemoryView(MemoryView):
    """A view that reads may land in."""

    __slots__ = ()
    writable: Literal[True] = True


class Owner(Protocol):
    """The endpoint a registration belongs to, as its memory handles use it."""

    def describe(self, registration: Registration, *, timeout: float | None) -> RemoteRegion: ...


class TransportMemory:
    """torch's ``Memory`` of this backend: a handle to one registration of ``owner``.

    Views (byte ranges, checked against the registration) and descriptors are made from it; a
    handle of a registration that was unregistered makes neither."""

    def __init__(self, owner: Owner, registration: Registration, reused: bool) -> None:
        self.owner = owner  # the endpoint that registered it
        self.registration = registration
        self._reused = reused

    def reused_registration(self) -> bool:
        """Whether this handle is an alias of a registration made before (the same tensor)."""
        return self._reused

    def _range(self, offset: int | None, length: int | None) -> tuple[int, int]:
        reg = self.registration
        reg.check()
        start = 0 if offset is None else operator.index(offset)
        if start < 0 or start > reg.length:
            raise ValueError(
                f"offset {start} is outside the registered memory (0 to {reg.length} bytes)"
            )
        size = reg.length - start if length is None else operator.index(length)
        if size < 0 or start + size > reg.length:
            raise ValueError(
                f"a view of {size} bytes at offset {start} exceeds the registered "
                f"{reg.length} bytes"
            )
        return start, size

    def to_view(self, offset: int | None = None, length: int | None = None) -> MemoryView:
        return MemoryView(self.registration, *self._range(offset, length))

    def to_mutable_view(
        self, offset: int | None = None, length: int | None = None
    ) -> MutableMemoryView:
        return MutableMemoryView(self.registration, *self._range(offset, length))

    def to_remote_buffer(self, *, timeout: float | None = None) -> RemoteRegion:
        """The descriptor of this registration, to hand to the peer that may use it."""
        self.registration.check()
        return self.owner.describe(self.registration, timeout=timeout)

    def __repr__(self) -> str:
        reg = self.registration
        state = "registered" if reg.active else "unregistered"
        return f"TransportMemory({reg.region}, {reg.length} bytes, {state})"
