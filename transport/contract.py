"""The internal contract between the core and the layers above it (weights/, integrations/).

Those layers import the public API (``transport``, ``transport.store``, ``transport.backends``)
and this module, nothing else of the core; ``tests/test_layering.py`` fails otherwise. This
module holds two things:

* :class:`CoreLink`, reached as ``transport.core``: the handful of calls of one Transport they
  need that users do not (control messages, a put that carries one, a fresh view of a peer, a
  peer's liveness, polling hints, the stream machinery).
* The core's helpers those layers share, re-exported here so that the core may move them:

  - closing: :class:`Closing` (a context manager that calls ``close()``);
  - bulk work: :func:`without_gc` (the garbage collector held off while it runs);
  - transfers: :func:`give_up` (a put's transfers withdrawn now, as their deadline would);
  - host memory: :class:`HostCopies` and :func:`native` (parallel copies between host tensors);
  - tensors: :func:`check_tensor`, :func:`dtype_name`; batches: :func:`make_batch`;
  - liveness: :func:`stale_after`, :func:`staleness`, ``GONE_BEATS``, ``GONE_MIN_S`` (when a
    peer's heartbeat says it is suspect or gone);
  - signed store values: :class:`SignedStore`, :class:`Inspector`; store counters:
    :class:`Counter`, :func:`index_counter`, :func:`clock_floor`;
  - messages: :func:`unpack` (strict, size-limited msgpack), :func:`is_count`, ``NAME_RE``,
    :func:`check_region_name`, ``MAX_RECORD_BYTES``.

Nothing else of the core is theirs to touch, and ruff's SLF001 (private member access) keeps
it so. Users should not need it; it may change with the library.

Control messages are the library's own notifications: each layer listens on a channel of its
own (``ws/<group>`` for a weight group), and a channel has one handler at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from transport._closing import Closing
from transport.gc_pause import without_gc
from transport.handle import give_up
from transport.host_copy import HostCopies, native
from transport.memory.local import check_tensor, dtype_name
from transport.peers.liveness import GONE_BEATS, GONE_MIN_S, stale_after, staleness
from transport.security.signed import Inspector, SignedStore
from transport.store.counters import Counter, clock_floor, index_counter
from transport.transfers.batch import make_batch
from transport.wire import MAX_RECORD_BYTES, NAME_RE, check_region_name, is_count, unpack

if TYPE_CHECKING:
    import torch

    from transport.handle import Handle
    from transport.transfers.batch import Batch
    from transport.wire import RegionInfo

__all__ = [
    "GONE_BEATS",
    "GONE_MIN_S",
    "MAX_RECORD_BYTES",
    "NAME_RE",
    "Closing",
    "ControlHandler",
    "CoreLink",
    "Counter",
    "HostCopies",
    "Inspector",
    "PeerView",
    "SignedStore",
    "check_region_name",
    "check_tensor",
    "clock_floor",
    "dtype_name",
    "give_up",
    "index_counter",
    "is_count",
    "make_batch",
    "native",
    "stale_after",
    "staleness",
    "unpack",
    "without_gc",
]

#: ``handler(peer, payload)``: runs on the engine thread, so it only does bookkeeping and hands
#: the rest to a thread of its own
ControlHandler = Callable[[str, bytes], None]


class PeerView(Protocol):
    """What a layer may read of a connection to a peer: its name, the incarnation it reaches, the
    regions its record lists, and whether host-memory transfers with it are one kernel copy each
    however many descriptors they have (``kernel_copies``: a peer of this machine reached through
    cross-memory attach), so that writing many small tensors as they are costs no more than
    packing them first."""

    @property
    def name(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def regions(self) -> Mapping[str, RegionInfo]: ...

    @property
    def kernel_copies(self) -> bool: ...


@dataclass(frozen=True)
class CoreLink:
    """The calls of one Transport that the layers above the core may make, and their rules.

    * ``check_open()``: raise ClosedError if the Transport is closed (or its engine died).
    * ``peer(name, refresh=False)``: connect to ``name`` (raises like a put would) and return
      what the connection shows; ``refresh`` reads its record afresh (its regions may have
      changed, or it may have restarted).
    * ``on_control(channel, handler)``: route control messages of ``channel`` to ``handler``;
      returns the call that stops it. A channel that already has a handler is refused
      (ValueError): two layers would steal each other's messages.
    * ``send_control(peer, channel, payload)``: a control message, after every transfer this
      Transport completed to ``peer`` before the call.
    * ``put_control(tensors, peer, channel, payload, timeout)``: a batched put (region names as
      keys, or a ``Transport.batch``) whose notification is a control message: it arrives after all of the data.
    * ``put_control_at(tensor, key, offset, peer, channel, payload, timeout)``: the same for one
      tensor at ``offset`` elements of region ``key``.
    * ``suspect(name, generation)``: why that incarnation of peer ``name`` is suspect, or None
      (transport/peers/liveness.py, judged with this Transport's heartbeat interval), or that it
      closed: one store read, its heartbeat (a second when there is none: whether it left), so
      a layer may ask it before every round of work; StoreError if the store cannot be reached.
    * ``heartbeat_key(name)``: the store key ``suspect`` reads first, for a layer that reads
      it ahead together with its own keys (``Store.reading_ahead``: one round trip for all).
    * ``poll_at_least(interval)``: keep the engine's idle polling at or below ``interval``
      seconds (None: back to sleeping until there is work); no layer needs it, since every peer
      that sends to us rings our doorbell (transport/doorbell.py), but a user may ask for it.
    * ``waiting(delta)``: a thread starts (+1) or stops (-1) waiting for a control message; the
      engine looks once at once, then sleeps until a ring as before.
    * ``stream_ops()``: the stream machinery of ``stream=`` calls (ClosedError when closed, a
      clear error without CUDA or CuPy).
    * ``record()``: this Transport's peer record as it stores it (sealed with a secret), to hand
      to a peer out of band (torch's transport API carries it in connection URLs and memory
      descriptors).
    * ``admit(record)``: connect to the peer whose record ``record`` is, received out of band:
      checked as a stored record is (SignatureError when it is not sealed with this Transport's
      secret; WireFormatError for another namespace, garbage, or a record of this very peer),
      then stored for lookups unless a newer revision of that incarnation is held, and
      connected afresh; returns what the connection shows.
    * ``forget(name, generation)``: that incarnation of peer ``name`` told us out of band (a
      control message of a layer, authenticated with a secret) that it is leaving: it is marked
      left in our store, as its own close marks it in a shared one, and its connection dropped;
      withdrawals stop waiting for it.
    * ``signed``: the store values this Transport writes and reads signed (transport/security/signed.py):
      every value of a layer that decides where bytes land or who takes part goes through it,
      so that with a secret a store writer without it cannot forge one.
    """

    check_open: Callable[[], None]
    peer: Callable[..., PeerView]
    on_control: Callable[[str, ControlHandler], Callable[[], None]]
    send_control: Callable[[str, str, bytes], None]
    put_control: Callable[
        [Mapping[str, torch.Tensor] | Batch, str, str, bytes, float | None], Handle
    ]
    put_control_at: Callable[[torch.Tensor, str, int, str, str, bytes, float | None], Handle]
    suspect: Callable[[str, int], str | None]
    heartbeat_key: Callable[[str], str]
    poll_at_least: Callable[[float | None], None]
    waiting: Callable[[int], None]
    stream_ops: Callable[[], Any]
    record: Callable[[], bytes]
    admit: Callable[[bytes], PeerView]
    forget: Callable[[str, int], None]
    signed: SignedStore
