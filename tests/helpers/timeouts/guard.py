"""A test that runs past its timeout fails, wherever pytest-timeout's alarm lands, and a test
that goes on after it does not hold up the run (a pytest plugin: tests/conftest.py loads it).

pytest-timeout's signal method raises ``Failed`` once, in whatever frame the main thread runs
when SIGALRM comes. Where CPython drops that frame's exceptions ("Exception ignored in ...": a
``__del__``, a weakref or garbage-collector callback, a generator the collector closes) or a
bare ``except`` goes on, the test went on: it passed past its limit, or hung with no second
alarm. With this plugin, once the alarm has come:

- it comes again every ``RETRY`` seconds, raising the timeout again, until a phase of the test
  (setup, call or teardown) ends with it; never inside pytest's own code between the phases,
  nor while the timeout is being handled (a ``finally`` or an ``__exit__`` cleaning up after
  it runs to its end, as it did with one alarm);
- a phase that ends without it (returned, skipped) is reported failed with it, the traceback
  showing where the alarm landed; a phase that failed on its own keeps its failure, and the
  report gets a "Timeout" section;
- a test still running ``timeout_grace`` seconds after the alarm (ini option, default 60) ends
  the process the way pytest-timeout's thread method does: the test's name, its captured output,
  every thread's stack, exit status 1 (xdist reports the test failed and starts a new worker).
  Where the main thread runs no Python at all (stuck in C), faulthandler does the same from its
  own thread another ``timeout_grace`` later.

Until its alarm comes, a test costs a few hook calls; the thread method is left as it is."""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest

#: seconds between the alarm's raises after the first, until the test ends with one
RETRY = 0.1

GRACE_HELP = (
    "Seconds a test may go on after its timeout's alarm (it is raised again meanwhile) before "
    "the process dumps the stacks and exits; a test stuck in C gets twice that. Default 60."
)

Handler = Callable[[int, FrameType | None], Any]


@dataclass
class Expiry:
    """A test whose alarm came: the first exception (its traceback shows where it landed) and
    each one raised again since."""

    item: pytest.Item
    message: str
    raised: list[BaseException]
    at: float = field(default_factory=time.monotonic)
    #: a phase ended with the timeout, or was reported failed with it
    settled: bool = False

    def owns(self, exc: BaseException | None) -> bool:
        """Whether ``exc`` is one of the timeout's exceptions, or was raised while handling one
        (its ``__context__`` or ``__cause__``)."""
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            if any(exc is r for r in self.raised):
                return True
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return False

    def where(self) -> str:
        """The frame the first alarm landed in: the last one before the signal handler."""
        landed = "an unknown frame"
        tb = self.raised[0].__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code is TimeoutGuard.on_alarm.__code__:
                break
            landed = f"{code.co_name} ({code.co_filename}:{tb.tb_lineno})"
            tb = tb.tb_next
        return landed

    def failure(self, when: str) -> BaseException:
        """The timeout, for a phase that ended without it, with the first alarm's traceback."""
        first = self.raised[0]
        exc = pytest.fail.Exception(
            f"{self.message} The alarm landed in {self.where()}, its exception was dropped on "
            f"the way out (an 'Exception ignored in' warning says where), and the {when} went "
            f"on: it ended {time.monotonic() - self.at:.1f}s later without it."
        )
        return exc.with_traceback(first.__traceback__)


class TimeoutGuard:
    """The plugin's state in one process: the test whose alarm came, if any."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.grace = float(config.getini("timeout_grace"))
        self.expiry: Expiry | None = None
        self.in_phase = False
        self.handler: Handler | None = None
        # the terminal's stderr, for the last words: the capture is suspended during configure
        self.stderr_fd = os.dup(2)

    def close(self) -> None:
        os.close(self.stderr_fd)

    @pytest.hookimpl(wrapper=True, optionalhook=True)
    def pytest_timeout_set_timer(
        self, item: pytest.Item, settings: Any
    ) -> Generator[None, object, object]:
        """Put ``on_alarm`` in front of the signal method's handler."""
        self.end()
        result = yield
        alarm = signal.getsignal(signal.SIGALRM)
        if (
            settings.method == "signal"
            and callable(alarm)
            and threading.current_thread() is threading.main_thread()
        ):
            self.handler = functools.partial(self.on_alarm, item, alarm)
            signal.signal(signal.SIGALRM, self.handler)
        return result

    def on_alarm(self, item: pytest.Item, alarm: Handler, signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        expiry = self.expiry
        if expiry is None:  # the timeout: pytest-timeout's handler raises it
            try:
                alarm(signum, frame)
            except BaseException as exc:
                self.expire(item, exc)
                raise
            return  # a debugger runs: pytest-timeout lets the test go on
        left = self.grace - (time.monotonic() - expiry.at)
        if left <= 0:
            self.give_up(expiry)
        if expiry.settled:  # the grace's alarm, early, or a retry's late
            if signal.getsignal(signal.SIGALRM) is self.handler:
                signal.setitimer(signal.ITIMER_REAL, left)
            return
        if not self.in_phase or expiry.owns(sys.exc_info()[1]):
            return  # between phases, or a handler of the timeout (finally, __exit__) runs
        again = pytest.fail.Exception(
            f"{expiry.message} Raised again: the alarm landed in {expiry.where()}, its "
            f"exception was dropped on the way out, and the test went on."
        )
        expiry.raised.append(again)
        raise again

    def expire(self, item: pytest.Item, exc: BaseException) -> None:
        self.expiry = Expiry(item, getattr(exc, "msg", None) or str(exc), [exc])
        signal.setitimer(signal.ITIMER_REAL, RETRY, RETRY)
        faulthandler.dump_traceback_later(2 * self.grace, exit=True, file=self.stderr_fd)

    def give_up(self, expiry: Expiry) -> None:
        """The test is still running ``grace`` seconds after its alarm: say so, show its
        output and every thread's stack, and end the process."""
        say = functools.partial(os.write, self.stderr_fd)
        try:
            say(
                f"\n{'+' * 20} Timeout {'+' * 20}\n{expiry.item.nodeid} FAILED: "
                f"{expiry.message} The alarm landed in {expiry.where()}, and the test is "
                f"still running {time.monotonic() - expiry.at:.1f}s later (raised again "
                f"{len(expiry.raised) - 1} times): ending the process.\n".encode()
            )
            capman = self.config.pluginmanager.getplugin("capturemanager")
            if capman is not None:
                capman.suspend_global_capture(in_=True)
                out, err = capman.read_global_capture()
                for name, text in (("stdout", out), ("stderr", err)):
                    if text:
                        say(f"{'~' * 20} Captured {name} {'~' * 20}\n{text}\n".encode())
            faulthandler.dump_traceback(file=self.stderr_fd, all_threads=True)
        finally:
            os._exit(1)

    def end(self) -> None:
        """The test whose alarm came has ended: no more alarms, no last words."""
        if self.expiry is None:
            return
        self.expiry = None
        if signal.getsignal(signal.SIGALRM) is self.handler:
            signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()

    def settle(self) -> None:
        """A phase is reported with the timeout: no more raising. One alarm stays, at the
        grace's end, for a test that still does not end (its teardown, say)."""
        assert self.expiry is not None
        self.expiry.settled = True
        if signal.getsignal(signal.SIGALRM) is self.handler:
            left = self.grace - (time.monotonic() - self.expiry.at)
            signal.setitimer(signal.ITIMER_REAL, max(left, RETRY))

    def phase(self) -> Generator[None, object, object]:
        self.in_phase = True
        try:
            return (yield)
        finally:
            self.in_phase = False

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self) -> Generator[None, object, object]:
        return (yield from self.phase())

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self) -> Generator[None, object, object]:
        return (yield from self.phase())

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_teardown(self) -> Generator[None, object, object]:
        return (yield from self.phase())

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """The first phase reported after the alarm carries the timeout."""
        expiry = self.expiry
        if expiry is None or expiry.settled or expiry.item is not item:
            return (yield)
        self.settle()
        own = call.excinfo
        if own is None or isinstance(own.value, pytest.skip.Exception):
            call.excinfo = pytest.ExceptionInfo.from_exception(expiry.failure(call.when))
        elif expiry.owns(own.value):
            return (yield)
        report = yield
        if own is not None and report.failed and call.excinfo is own:
            report.sections.append(("Timeout", expiry.failure(call.when).args[0]))
        return report

    def pytest_runtest_logfinish(self) -> None:
        self.end()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("timeout_grace", GRACE_HELP, default="60")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TimeoutGuard(config), "timeout-guard")


def pytest_unconfigure(config: pytest.Config) -> None:
    guard = config.pluginmanager.get_plugin("timeout-guard")
    if isinstance(guard, TimeoutGuard):
        guard.close()
