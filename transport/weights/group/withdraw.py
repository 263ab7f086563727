"""Giving back the regions a publisher or subscriber of a group exposed, when it closes, so that a
new one of the same group on the same Transport can expose its own.

All of them go through one call of the public ``Transport.unexpose`` with the list of names
(README, "Withdrawing memory"): out of the record at once (one record written), every peer stops
writing them and confirms, then the memory is deregistered. Rules:

* one budget: ``min(transport.timeout, WITHDRAW_S)`` seconds; a peer that does not answer within
  it (frozen, partitioned) is logged by the core and may still write there, as ``unexpose`` says;
* a region the call could not withdraw (it failed) stays exposed, logged; the next publisher or
  subscriber of that group on this Transport withdraws it before it exposes its own
  (:func:`leftovers`): it holds the group's control channel, so no live member of the group on
  this Transport owns them;
* a closed Transport has nothing exposed any more: nothing to do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from transport import ClosedError

if TYPE_CHECKING:
    from transport import Transport

log = logging.getLogger(__name__)

#: the most seconds a close spends withdrawing its regions
WITHDRAW_S = 10.0


def withdraw(transport: Transport, names: Iterable[str], what: str) -> list[str]:
    """Withdraw the regions ``names`` of ``transport`` (see the module's rules); returns those
    that stay exposed. ``what`` names their owner in the log."""
    exposed = set(transport.regions())
    todo = [n for n in dict.fromkeys(names) if n in exposed]
    if not todo:
        return []
    try:
        transport.unexpose(todo, timeout=min(transport.timeout, WITHDRAW_S))
    except ClosedError:
        return []  # a closed Transport exposes nothing
    except Exception:
        log.exception("%s: withdrawing its %d regions failed; they stay exposed", what, len(todo))
        return todo
    return []


def leftovers(transport: Transport, group: str) -> None:
    """Before a publisher or subscriber of ``group`` exposes its regions (holding the group's
    channel): withdraw what a closed one of the group left exposed on ``transport``."""
    prefix = f"{group}@"
    stale = []
    for name in transport.regions():
        slot, sep, _ = name[len(prefix) :].partition("/")
        ours = slot in ("pub", "mode", "rank") or slot.isascii() and slot.isdigit()
        if name.startswith(prefix) and sep and ours:
            stale.append(name)
    if stale:
        withdraw(transport, stale, f"group {group} (what a closed member left)")
