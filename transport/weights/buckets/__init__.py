"""A stream of self-describing buckets through two slots per receiver: for trainers whose
receivers learn names, shapes and dtypes only as the tensors arrive (verl's checkpoint engine,
transport/integrations/verl/, runs on it). Each bucket carries its own header; every trainer rank
sees the whole stream and the ranks split the buckets without talking; receivers relay in a tree
above a few of them. Framework-free: it needs only this library.

What it shares with the weight groups (one implementation each, in weights/): the control
messages' codec (message_codec.py), the relay tree's shape (relay_tree.py), slot credits
(slot_credits.py: a ``Free`` is a numbered credit, slot ``k % 2`` for bucket ``k``),
supersession (supersession.py: a newer update's token supersedes the running update), the
judgment of the peers it waits on (peer_watch.py) and the changes of a delta update
(weights/delta/: the same blob, checked whole before a byte is written). What is its own
follows from a stream whose layout nobody knows in advance: a bucket's header instead of a
declared layout, an update's token instead of a group's versions and leases, and ``Stop``,
which ends an update (a group's ``Abort`` gives up one write into one slot).
"""

from transport.weights.buckets.buckets import Assembler
from transport.weights.buckets.changes import PieceCopies
from transport.weights.buckets.inbox import Inbox
from transport.weights.buckets.receiver import BucketReceiver
from transport.weights.buckets.sender import BucketSender
from transport.weights.buckets.targets import SLOTS
from transport.weights.buckets.topology import EngineInfo, UpdatePlan, build_plans

__all__ = [
    "SLOTS",
    "Assembler",
    "BucketReceiver",
    "BucketSender",
    "EngineInfo",
    "Inbox",
    "PieceCopies",
    "UpdatePlan",
    "build_plans",
]
