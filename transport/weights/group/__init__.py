"""What publishers and subscribers of a weight group say to each other, and where they meet.

Store keys, under ``transport/<namespace>/groups/<group>/``:

* ``epoch``: bumped by every join and leave, so a publisher notices changes with one read
* ``members/count``, ``members/<i>``, ``members/by-name/<name>``: every name that ever joined
* ``sub/<name>``: the subscriber's entry (generation, instance, mode, slots, relay) while it is in
  the group; the instance tells apart subscribers that one Transport makes one after another
* ``layout/<name>``: the destination layout the subscriber declared (for a sharded trainer)
* ``lease``, ``lease/<rank>``, ``ranks``: the publishers and their number (``lease``)
* ``published/<rank>``: the version a rank of a sharded trainer began last

All but the counters and the membership index are signed values (``transport/security/signed.py``),
each written only by the one peer it is about (see :class:`GroupDirectory` and ``lease``).
What a process that writes the store can still do:

* with a secret it lacks: delete any value, or put garbage or an unsigned value in its place
  (readers ignore it and log it: the same as a deletion): a subscriber is then left out of
  publishes until it writes its own entry, index place and layout back (it checks every
  second; a large layout is read back whole at most 64 KiB a second); a rank's lease or the
  rank count is written back by its holder at its next publish, and until then subscribers
  refuse that rank's messages (a version is given up, never torn); a deleted lease lets a
  second publisher start while the first is alive (the first stops at its next publish with
  GroupBusyError). Put back an older value of the same key: one of an older incarnation is
  refused (its generation is not the live record's) and its owner writes its own back; one of
  the same incarnation is the same value, unless that Transport published the group before
  with another rank or world (a lease then believed as if it held it now). Raise the member
  count (at most 65,536: that many reads at a publisher's next full read of the group), bump
  the epoch (a re-read), hide or show names in the index (only signed entries count).
* without a secret it is trusted like any peer: it can write any entry, layout, lease or rank
  count as its subject's own (a sharded publisher then writes ``q`` from ``o``, or a version
  completes with one rank's parts), except that an entry's slots must still match what the
  subscriber's record exposes, so a staging subscriber is never written in place. Garbage still
  stops nobody: it is skipped with a warning and its owner writes its value back.

Control messages travel as notifications on channel ``ws/<group>``: msgpack maps on the wire, the
typed values of ``_messages`` (named here in brackets) in the code.

* publisher -> subscriber ``{"k": "hello"}`` (Hello): tell me which slots I may write
* publisher -> subscriber ``{"k": "begin", "v": N, "s": slot}`` (Begin): version N is being
  written
* publisher -> subscriber ``{"k": "ver", "v": N, "s": slot}`` (Ver): the notification of the data
  put: every tensor of version N has landed in ``slot``
* subscriber -> publisher ``{"k": "credit", "s": [slots], "v": newest}`` (Credit): the slots it
  may write now
* publisher -> subscriber ``{"k": "abort", "v": N, "s": slot}`` (Abort): the write of version N
  into ``slot`` was given up (its deadline passed, or its relay failed): a ``ver`` of it that
  still comes is ignored, so a slot the subscriber credits next is never also a version it
  completes; answered like ``hello``
* publisher -> subscriber ``{"k": "lend", "v": N}`` (Lend): the slot version N was to land in is
  cut off (its relay became suspect on the way and owns it until it reports or is gone): hand
  back the slot of your newest version if you applied it (no longer readable from staging, as
  with one slot) and credit again; the publisher writes N there itself, so a chain closes over a
  lost relay within the publish. Answered with a credit, lent or not.

Delta updates (``delta=True`` on both sides; weights/delta/):

* publisher -> subscriber ``{"k": "patch", "v": N, "s": slot, "p": B, "n": bytes}`` (Patch): the
  notification of a put into the subscriber's inbox (region ``<group>@delta/inbox``): the changes
  that make version N out of version B have landed there (``bytes`` of it). The subscriber copies
  the slot holding B whole into ``slot``, applies the changes there and completes N, or refuses.
* subscriber -> publisher ``{"k": "patched", "v": N, "s": slot, "e": why}`` (Patched): N is
  complete in ``slot`` (``why`` empty), or why the changes were refused (it holds another
  version, they break a rule of their format); the publisher then writes N whole into ``slot``
  within the same deadline. The inbox is written again only once its changes were answered.

Relayed fan-out (the publisher's ``fanout`` is ``chain`` or ``tree``):

* publisher -> relay ``{"k": "fwd", "v": N, "t": ms, "to": [[child, slot, relays, base], ...]}``
  (Forward): write version N into each child's slot (within ``t`` milliseconds) as it lands here;
  ``relays`` (0/1): the child forwards it in turn, so announce each segment to it; ``base``: the
  version the child holds whole (-1: none), onto which the version's changes may go
* writer -> relay ``{"k": "seg", "v": N, "s": slot, "a": i, "b": j}`` (Segment): the notification
  of one segment of version N: the tensors ``i`` to ``j - 1`` of the relay's names in sorted order
  have landed in ``slot``; the relay forwards them at once (a pipeline: every hop copies while the
  one before it still writes). The writer's last segment carries ``ver`` and is posted only after
  the others have landed, so ``ver`` still means "all of it".
* writer -> relay ``{"k": "part", "v": N, "s": slot, "a": i, "o": offset, "n": bytes}`` (PartLanded):
  the notification of one piece of a tensor larger than a segment: bytes ``offset`` to
  ``offset + bytes - 1`` of tensor ``i`` have landed; the relay forwards them at once, so one huge
  tensor (an embedding) is pipelined too.
* relay -> publisher ``{"k": "fwdr", "v": N, "c": child, "x": outcome, "e": why, "n": bytes}``
  (Report): what became of one forward: outcome ``""`` (landed), ``"lost"`` (the child went away:
  the publisher drops it until it joins again) or ``"fail"`` (anything else, a child whose record
  the store lacks for the moment included: it misses that version and is tried again at the
  next); ``n``: the bytes of changes the relay wrote and the child applied (0: it took the
  version whole, or the forward did not land)

A staging subscriber has two slots. It never credits the slot that holds its newest complete
version, nor the slot an ``apply()`` is copying from, nor a slot it is forwarding from, so nobody
writes what is read. The publisher alone hands out the slots of every subscriber (children credit
the publisher, whoever writes them), and it gives a slot written by a relay back only when that
relay has reported on it (on that version or a later one: its writes to that child have drained)
or is gone, so two writers never share a slot. Meanwhile the slot is fenced: the subscriber has
one slot left, and every version it takes goes into its newest version's slot once applied
(``lend``), as for a one-slot subscriber.
"""

from transport.weights.group.messages import MAX_DEGREE
from transport.weights.group.segments import SEGMENT_BYTES

__all__ = ["MAX_DEGREE", "SEGMENT_BYTES"]
