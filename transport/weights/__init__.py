"""Weight sync for RL: a publisher (the trainer), or one per rank of a sharded trainer, and
subscribers (generators) of a named group, each in the layout and dtype it declares.

Two protocols run on it: the weight groups (group/, publishing/, subscribing/: layouts declared
up front, versions written into credited slots) and the bucket stream (buckets/: self-describing
buckets for receivers that learn the layout as it arrives, verl's). The ideas both use exist
once, here: the control messages' codec (message_codec.py), the relay tree (relay_tree.py), the
judgment of the peers waited on (peer_watch.py), the changes of delta updates (delta/) and the
layouts (layouts/)."""

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
