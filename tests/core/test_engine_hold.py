"""A thread that posted a small transfer polls it itself while it waits (``Handle.wait``'s
spin); the engine's own polls of it would only contend with the waiter for the interpreter, so
the waiter holds them off for the length of its spin, at most ``HOLD_S``, and hands the transfer
back to the engine when it stops spinning. The rule is read from the engine's sleep; that puts
and gets still complete while a waiter holds the engine is shown by every test that waits on a
put (tests/core/test_idle.py, across TCP with the engine asleep)."""

from __future__ import annotations

import pytest

from helpers import internals
from transport.backends.loopback import LoopbackBackend
from transport.handle import SPIN_S
from transport.progress_engine import ProgressEngine

pytestmark = pytest.mark.unit

#: the engine's poll interval with a transfer in flight and no waiter spinning on it
IN_FLIGHT_POLL_S = 100e-6


@pytest.fixture
def engine():
    backend = LoopbackBackend("hold")
    e = ProgressEngine(backend, "hold", lambda notifs: None, lambda conn, err: None)
    yield e  # never started: its sleep is read, not slept
    e.stop()
    backend.close()


#: a hold far longer than any stall of a loaded machine between two lines of a test
LONG_S = 60.0


def test_a_spinning_waiter_holds_the_engines_polls_and_hands_them_back_when_it_stops(engine):
    assert internals.engine_interval(engine, in_flight=True) == pytest.approx(IN_FLIGHT_POLL_S)
    poller = engine.poller([])
    poller.spin(LONG_S)
    assert internals.engine_interval(engine, in_flight=True) > LONG_S / 2
    poller.spin(SPIN_S)  # a shorter hold (another waiter's) does not cut it short
    assert internals.engine_interval(engine, in_flight=True) > LONG_S / 2
    assert not internals.doorbell_woken(engine)
    poller.spin(0)  # the waiter stopped spinning: the engine polls again, woken now
    assert internals.engine_interval(engine, in_flight=True) == pytest.approx(IN_FLIGHT_POLL_S)
    assert internals.doorbell_woken(engine)


def test_a_hold_leaves_an_engine_with_nothing_in_flight_as_it_was(engine):
    engine.poller([]).spin(LONG_S)
    assert internals.engine_interval(engine, in_flight=False) <= engine.idle_interval
