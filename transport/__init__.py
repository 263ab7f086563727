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

from transport._default import default, get, init, is_initialized, put, shutdown
from transport._transport import Notification, PeerInfo, PeerTraffic, Transport, __version__
from transport.errors import (
    BackendError,
    ClosedError,
    GroupBusyError,
    PeerLostError,
    PeerNotFoundError,
    PeerWaitTimeout,
    RegionError,
    RegistrationBudgetError,
    SignatureError,
    StoreError,
    StoreTimeout,
    TransferTimeout,
    TransportError,
    VersionGoneError,
    WireFormatError,
)
from transport.handle import Handle, wait_all
from transport.store import Store, store_from_url
from transport.transfers.batch import Batch
from transport.weights import (
    PublishHandle,
    PublishResult,
    Snapshot,
    WeightPublisher,
    WeightSubscriber,
)
from transport.wire import RegionInfo

__all__ = [
    "BackendError",
    "Batch",
    "ClosedError",
    "GroupBusyError",
    "Handle",
    "Notification",
    "PeerInfo",
    "PeerTraffic",
    "PeerLostError",
    "PeerNotFoundError",
    "PeerWaitTimeout",
    "PublishHandle",
    "PublishResult",
    "RegionError",
    "RegistrationBudgetError",
    "RegionInfo",
    "SignatureError",
    "Snapshot",
    "Store",
    "StoreError",
    "StoreTimeout",
    "TransferTimeout",
    "Transport",
    "TransportError",
    "VersionGoneError",
    "WeightPublisher",
    "WeightSubscriber",
    "WireFormatError",
    "__version__",
    "default",
    "get",
    "init",
    "is_initialized",
    "put",
    "shutdown",
    "store_from_url",
    "wait_all",
]
