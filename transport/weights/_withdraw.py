"""Giving back the regions a publisher or subscriber of a group exposed, when it closes, so that a
new one of the same group on the same Transport can expose its own.

Each region goes through the public ``Transport.unexpose`` (README, "Withdrawing memory"): out of
the record, every peer stops writing it and confirms, then the memory is deregistered. Rules:

* one budget for all of them: ``min(transport.timeout, WITHDRAW_S)`` seconds, shared by a few
  withdrawals at a time (each waits for the peers' answers, which overlap); a peer that does not
  answer within what is left of it (frozen, partitioned) is logged by the core and may still
  write there, as ``unexpose`` says;
* regions not yet withdrawn when the budget is spent stay exposed (logged): each withdrawal
  rewrites this Transport's record, so a group of very many tensors costs time in the square
  of their number, and a close must end. The next publisher or subscriber of that group on this
  Transport withdraws them before it exposes its own (:func:`leftovers`): it holds the group's
  control channel, so no live member of the group on this Transport owns them;
* a closed Transport has nothing exposed any more: nothing to do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from transport.errors import ClosedError

if TYPE_CHECKING:
    from transport import Transport

log = logging.getLogger("transport.weights")

#: the most seconds a close spends withdrawing its regions
WITHDRAW_S = 10.0
#: withdrawals in flight at once
PARALLEL = 4


def withdraw(transport: Transport, names: Iterable[str], what: str) -> list[str]:
    """Withdraw the regions ``names`` of ``transport`` (see the module's rules); returns those
    that stay exposed. ``what`` names their owner in the log."""
    todo = list(names)
    if not todo:
        return []
    budget = min(transport.timeout, WITHDRAW_S)
    deadline = time.monotonic() + budget
    lock = threading.Lock()
    left: list[str] = []
    queue = iter(todo)
    closed = threading.Event()

    def work() -> None:
        while True:
            with lock:
                name = next(queue, None)
                if name is None:
                    return
                wait = deadline - time.monotonic()
                if wait <= 0 or closed.is_set():
                    left.append(name)
                    continue
            try:
                transport.unexpose(name, timeout=wait)
            except KeyError:
                pass  # not exposed (any more)
            except ClosedError:
                closed.set()  # a closed Transport exposes nothing
            except Exception:  # the others still go
                log.exception("%s: withdrawing region %s failed", what, name)
                with lock:
                    left.append(name)

    helpers = [
        threading.Thread(target=work, name="transport-ws-withdraw", daemon=True)
        for _ in range(min(PARALLEL, len(todo)) - 1)
    ]
    for h in helpers:
        h.start()
    work()
    for h in helpers:
        h.join()
    if closed.is_set():
        return []
    if left:
        log.warning(
            "%s: %d of its %d regions stay exposed: withdrawing them took more than %g s (each "
            "withdrawal rewrites this Transport's record); the next publisher or subscriber of "
            "the group on this Transport withdraws them first",
            what, len(left), len(todo), budget,
        )  # fmt: skip
    return left


def leftovers(transport: Transport, group: str) -> None:
    """Before a publisher or subscriber of ``group`` exposes its regions (holding the group's
    channel): withdraw what a closed one of the group left exposed on ``transport``."""
    prefix = f"{group}@"
    stale = []
    for name in transport.regions():
        slot, sep, _ = name[len(prefix) :].partition("/")
        if name.startswith(prefix) and sep and (slot == "pub" or slot.isascii() and slot.isdigit()):
            stale.append(name)
    if stale:
        withdraw(transport, stale, f"group {group} (what a closed member left)")
