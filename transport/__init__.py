"""transport: one-sided, asynchronous tensor transfer between processes.

Peers find each other through a key-value store (an embedded TCPStore by
default, Redis for clusters); memory is registered with NIXL; ``put`` writes
straight into a peer's exposed tensor and returns a handle at once.

>>> import transport
>>> with transport.Transport("gen-0") as t:          # receiver
...     t.expose("w", torch.zeros(1024))
>>> with transport.Transport("trainer-0") as t:      # writer
...     t.put(torch.ones(1024), "gen-0", "w").wait(timeout=10)
"""

from typing import TYPE_CHECKING, Any

from transport._default import default, get, init, is_initialized, put, shutdown
from transport._transport import Notification, PeerInfo, PeerTraffic, Transport, __version__
from transport.errors import (
    BackendError,
    CliError,
    ClosedError,
    ClusterError,
    DeltaError,
    GroupBusyError,
    LayoutError,
    PeerGoneError,
    PeerLostError,
    PeerNotFoundError,
    PeerWaitTimeout,
    RegionError,
    RegistrationBudgetError,
    RouteError,
    SignatureError,
    StoreError,
    StoreTimeout,
    SyncError,
    TornModelError,
    TransferTimeout,
    TransportError,
    UpdateAbortedError,
    UpdateError,
    UpdateSupersededError,
    VersionGoneError,
    WireFormatError,
)
from transport.handle import Handle, wait_all
from transport.store import Store, store_from_url
from transport.transfers.batch import Batch
from transport.wire import RegionInfo

if TYPE_CHECKING:
    from transport.weights import (
        PublishHandle,
        PublishResult,
        Snapshot,
        WeightPublisher,
        WeightSubscriber,
    )

#: the weight-sync names, loaded from transport.weights on first use: importing the core (this
#: package, or any module of it) never imports the layers above it
_WEIGHT_NAMES = frozenset(
    {"PublishHandle", "PublishResult", "Snapshot", "WeightPublisher", "WeightSubscriber"}
)

__all__ = [
    "BackendError",
    "Batch",
    "CliError",
    "ClosedError",
    "ClusterError",
    "DeltaError",
    "GroupBusyError",
    "Handle",
    "LayoutError",
    "Notification",
    "PeerGoneError",
    "PeerInfo",
    "PeerLostError",
    "PeerNotFoundError",
    "PeerTraffic",
    "PeerWaitTimeout",
    "PublishHandle",
    "PublishResult",
    "RegionError",
    "RegionInfo",
    "RegistrationBudgetError",
    "RouteError",
    "SignatureError",
    "Snapshot",
    "Store",
    "StoreError",
    "StoreTimeout",
    "SyncError",
    "TornModelError",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "UpdateAbortedError",
    "UpdateError",
    "UpdateSupersededError",
    "VersionGoneError",
    "WeightPublisher",
    "WeightSubscriber",
    "WireFormatError",
    "default",
    "get",
    "init",
    "is_initialized",
    "put",
    "shutdown",
    "store_from_url",
    "wait_all",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """The weight-sync names of ``__all__``, imported from transport.weights when first asked."""
    if name in _WEIGHT_NAMES:
        import transport.weights as weights

        value = getattr(weights, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'transport' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _WEIGHT_NAMES)
