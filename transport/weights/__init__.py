"""Weight sync for RL: a publisher (the trainer) and subscribers (generators) of a named group."""

from transport.weights._delivery import PublishHandle, PublishResult
from transport.weights._flat import flat_like
from transport.weights.publisher import WeightPublisher
from transport.weights.subscriber import Snapshot, WeightSubscriber

__all__ = [
    "PublishHandle",
    "PublishResult",
    "Snapshot",
    "WeightPublisher",
    "WeightSubscriber",
    "flat_like",
]
