"""Weight sync for RL: a publisher (the trainer), or one per rank of a sharded trainer, and
subscribers (generators) of a named group, each in the layout and dtype it declares.

Two protocols run on it: the weight groups (group/, publishing/, subscribing/: layouts declared
up front, versions written into credited slots) and the bucket stream (buckets/: self-describing
buckets for receivers that learn the layout as it arrives, verl's). The ideas both use exist
once, here, and both protocols use them: the control messages' codec (message_codec.py), the
relay tree (relay_tree.py), slot credits (slot_credits.py), supersession (supersession.py), the
judgment of the peers waited on (peer_watch.py), the changes of delta updates (delta/) and the
layouts (layouts/).

What each protocol calls an abort is not one idea, and so has two names: a group's ``Abort``
gives up one write into one slot (the slot's credit comes back with the subscriber's answer);
the bucket stream's ``Stop`` ends a whole update for the peers it is sent to (whole: for
every worker)."""

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
