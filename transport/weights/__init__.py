"""Weight sync for RL: a publisher (the trainer), or one per rank of a sharded trainer, and
subscribers (generators) of a named group, each in the layout and dtype it declares."""

from transport.weights.layouts import (
    DestTensor,
    Piece,
    Slice,
    SourceLayout,
    flat_like,
    fp8,
    full_copy,
    tensors_for,
    tp_shard,
)
from transport.weights.publishing.delivery import PublishHandle, PublishResult
from transport.weights.publishing.publisher import WeightPublisher
from transport.weights.publishing.sharded import ShardedPublisher
from transport.weights.subscribing.snapshot import Snapshot
from transport.weights.subscribing.subscriber import WeightSubscriber
from transport.weights.subscribing.window import WindowedSubscriber

__all__ = [
    "DestTensor",
    "Piece",
    "PublishHandle",
    "PublishResult",
    "ShardedPublisher",
    "Slice",
    "Snapshot",
    "SourceLayout",
    "WeightPublisher",
    "WeightSubscriber",
    "WindowedSubscriber",
    "flat_like",
    "fp8",
    "full_copy",
    "tensors_for",
    "tp_shard",
]
