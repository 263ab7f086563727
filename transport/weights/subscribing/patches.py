"""A subscriber's delta versions: its inbox, the changes applied onto a slot, and free slots
made copies of the newest version so that the next version's changes apply onto them."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from transport.weights.group.messages import Patch
from transport.weights.subscribing.delta_inbox import DeltaInbox, delta_inbox
from transport.weights.subscribing.slots import Slots

log = logging.getLogger(__name__)


class Patches:
    """Owns a subscriber's delta inbox (None: it takes versions whole only) and the count of
    versions that came as changes (``patched``) or whose changes it refused (``refused``).

    Rules: changes apply only onto a slot that holds their base whole and that no other
    version was begun in (weights/subscribing/slots.py), and are checked whole before a byte
    is written. A staging slot that becomes free and holds another version than the newest is
    made a copy of the newest (primed, on the worker thread, before any publisher is offered
    it), so that every publisher, every rank of a sharded trainer too, may write the next
    version's changes into it with no copy on the way. :meth:`freeing` wraps each change of
    state that may free a slot, under the subscriber's lock."""

    def __init__(
        self,
        delta: object,
        staging: list[dict[str, torch.Tensor]],
        slots: Slots,
        in_place: bool,
        submit: Callable[[Callable[[], object]], None],
        credit: Callable[[], None],
    ) -> None:
        self.inbox: DeltaInbox | None = delta_inbox(delta, staging)
        self.slots, self.in_place = slots, in_place
        self._submit, self._credit = submit, credit
        self.patched = 0
        self.refused = 0

    @contextlib.contextmanager
    def freeing(self) -> Iterator[None]:
        """Under the lock: prime the slots the wrapped change frees."""
        before = self.slots.free() if self.inbox is not None and not self.in_place else None
        yield
        if before is not None and (job := self.slots.to_prime(before)) is not None:
            self._submit(functools.partial(self._prime, *job))

    def _prime(self, src: int, dst: list[int]) -> None:
        """Worker: make ``dst`` copies of slot ``src``, then offer them."""
        assert self.inbox is not None
        ok = True
        try:
            for k in dst:
                self.inbox.prime(src, k)
        except Exception as e:  # the slots then hold nothing whole: versions come whole
            log.warning("could not copy slot %d into slots %s: %s", src, dst, e)
            ok = False
        with self.slots.lock:
            self.slots.primed(src, dst, ok)
            self.slots.lock.notify_all()
        self._credit()

    def apply(self, m: Patch, window: bool, single: bool) -> str:
        """Worker: apply the changes ``m`` announces onto its slot; "" when done, else why not
        (nothing was written). ``window``: the live tensors may be written now (in place).
        ``single``: one publisher writes the version (not the ranks of a sharded trainer): a
        slot that holds another version is first made a copy of the newest one if that is the
        base (no other writer can be writing the slot meanwhile)."""
        src = None
        with self.slots.lock:
            why = "it has no inbox for changes, or its window is shut"
            if self.inbox is not None and window:
                why, src = self.slots.patch_target(m.slot, m.version, m.base, self.in_place, single)
        if not why:
            assert self.inbox is not None
            if src is not None:
                try:
                    self.inbox.prime(src, m.slot)
                finally:
                    with self.slots.lock:
                        self.slots.unpin(src)
            why = self.inbox.made(m.slot, m.version, m.base, m.at, m.nbytes)
        if why:
            self.refused += 1
        else:
            self.patched += 1
        return why
