"""A subscriber's place in its group's directory while it lives, and its leaving.

:class:`Membership` owns the subscriber's entry as the group directory holds it: the periodic
check that puts it back when the store lost it (``check_in``) and the leave at close, one at a
time, so that a check that read the entry before the leave never puts it back after (the
closed subscriber would stay in the group, planned by the publisher, its regions withdrawn).
"""

from __future__ import annotations

import logging
import threading

from transport import TransportError
from transport.weights.group.group_directory import GroupDirectory

log = logging.getLogger(__name__)


class Membership:
    """The entry of one subscriber (``mode``, ``slots``, ``relay``, its declared layout) in
    ``directory`` (see the module docstring). Rules: no check begins once :meth:`leave` began;
    :meth:`leave` waits for a check in flight at most ``wait`` seconds (each of its store calls
    has the store's deadline), then leaves anyway and says so."""

    def __init__(
        self,
        directory: GroupDirectory,
        mode: str,
        slots: int,
        relay: bool,
        declared: bytes | None,
    ) -> None:
        self.directory = directory
        self.mode, self.slots, self.relay, self.declared = mode, slots, relay, declared
        self._lock = threading.Lock()
        self._left = False

    def check_in(self, full: bool) -> str:
        """``GroupDirectory.check_in`` of the entry (what was put back, or ""), unless the leave
        began."""
        with self._lock:
            if self._left:
                return ""
            return self.directory.check_in(self.mode, self.slots, self.relay, self.declared, full)

    def leave(self, wait: float) -> None:
        """Leave the group once the check in flight (if any) has ended; no check begins after."""
        got = self._lock.acquire(blocking=False)
        if not got:
            log.debug(
                "group %s: leaving waits for the check of its entry in flight", self.directory.group
            )
            got = self._lock.acquire(timeout=wait)
            if not got:
                log.warning(
                    "group %s: the check of our entry did not end in time; leaving anyway (it "
                    "may put the entry back: publishers then find its regions gone)",
                    self.directory.group,
                )
        try:
            self._left = True
            self.directory.leave()
        except TransportError as e:
            log.warning("could not leave group %s: %s", self.directory.group, e)
        finally:
            if got:
                self._lock.release()
