"""Weight sync for RL: a publisher (the trainer), or one per rank of a sharded trainer, and
subscribers (generators) of a named group, each in the layout and dtype it declares."""

from transport.weights._delivery import PublishHandle, PublishResult
from transport.weights._flat import flat_like
from transport.weights.layouts import (
    DestTensor,
    LayoutError,
    Piece,
    Slice,
    SourceLayout,
    fp8,
    full_copy,
    tensors_for,
    tp_shard,
)
from transport.weights.publisher import WeightPublisher
from transport.weights.sharded import ShardedPublisher
from transport.weights.subscriber import Snapshot, WeightSubscriber
from transport.weights.window import WindowedSubscriber

__all__ = [
    "DestTensor",
    "LayoutError",
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
