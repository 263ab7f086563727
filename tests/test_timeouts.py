"""A test past its timeout fails wherever pytest-timeout's alarm lands, and one that goes on
after it ends the process instead of holding up the run (helpers/timeouts/guard.py, which
tests/conftest.py loads).

Each case is a generated test that pytest runs in a child process with the guard and
pytest-timeout's signal method, its outcome read from the JUnit report. A generated test does not
wait for its deadline to come: it moves it to now (``signal.setitimer``, the timer pytest-timeout
set) from inside the frame it means the alarm to land in, and stays there until the alarm's
exception takes it out. The alarm cannot land anywhere else, however slow the machine; a file the
alarm left records that it came there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.timeouts.guard import TimeoutGuard

TESTS = Path(__file__).parent

#: the generated tests' helpers: ``land_alarm(mark)`` brings the alarm into its caller's frame
PRELUDE = '''
import ctypes
import gc
import os
import signal
import time
import weakref
from pathlib import Path

import pytest

MARKS = Path(os.environ["ALARM_MARKS"])


def land_alarm(mark):
    """The deadline moved to now, waited for here: only the alarm's exception ends the wait."""
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        while True:
            time.sleep(0.01)  # sync-ok: only the alarm ends this wait
    finally:
        (MARKS / mark).touch()


class LandsInDel:
    def __init__(self, mark):
        self.mark = mark

    def __del__(self):
        land_alarm(self.mark)
'''

#: tests whose alarm is dropped, and the tests beside them
LANDINGS = """
def test_passes():
    pass


def test_fails_on_its_own():
    assert 1 + 1 == 3, "its own failure"


@pytest.mark.timeout(60)
def test_alarm_in_gc_callback():
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(phase)
            land_alarm("gc_callback")

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)


@pytest.mark.timeout(60)
def test_alarm_in_del():
    LandsInDel("del")


@pytest.mark.timeout(60, func_only=True)
def test_alarm_in_del_func_only():
    LandsInDel("del_func_only")


@pytest.mark.timeout(60)
def test_alarm_in_weakref_callback():
    class Target:
        pass

    target = Target()
    ref = weakref.ref(target, lambda _: land_alarm("weakref"))
    del target
    assert ref() is None


@pytest.mark.timeout(60)
def test_alarm_in_bare_except():
    try:
        land_alarm("bare_except")
    except BaseException:
        pass


@pytest.mark.timeout(60)
def test_alarm_in_del_then_loops():
    LandsInDel("then_loops")
    while True:
        time.sleep(0.01)  # sync-ok: only the alarm ends this wait


@pytest.fixture
def lands_alarm_in_setup():
    LandsInDel("setup")
    yield
    (MARKS / "teardown_ran").touch()


@pytest.mark.timeout(60)
def test_alarm_in_setup(lands_alarm_in_setup):
    (MARKS / "body_ran").touch()


@pytest.mark.timeout(60)
def test_alarm_in_del_then_own_failure():
    LandsInDel("own_failure")
    assert 1 + 1 == 3, "its own failure after the alarm"


@pytest.mark.timeout(60)
def test_cleanup_after_the_alarm_runs_to_its_end():
    try:
        land_alarm("cleanup_started")
    finally:
        end = time.monotonic() + 0.5  # five times the guard's retry
        while time.monotonic() < end:
            time.sleep(0.01)  # sync-ok: only the alarm ends this wait
        (MARKS / "cleanup_done").touch()


@pytest.mark.timeout(1)
def test_real_deadline_in_del():
    class WaitsForTheAlarm:
        def __del__(self):
            while True:
                time.sleep(0.01)  # sync-ok: only the alarm ends this wait

    WaitsForTheAlarm()


def test_passes_after_the_alarms():
    pass
"""

#: a test that drops every alarm it gets, and one after it
SWALLOWS = """
class SwallowsEverything:
    def __del__(self):
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        while True:
            try:
                time.sleep(0.01)  # sync-ok: only the alarm ends this wait
            except BaseException:
                (MARKS / "swallowed").touch()


@pytest.mark.timeout(60)
def test_keeps_swallowing():
    print("the stuck test's output")
    SwallowsEverything()


def test_after_the_stuck_one():
    pass
"""

#: a test that drops its alarm, then waits in C holding the GIL with the alarm blocked
STUCK_IN_C = """
@pytest.mark.timeout(60)
def test_stuck_in_c():
    LandsInDel("c")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    ctypes.PyDLL(None).sleep(600)  # sync-ok: stuck in C, ended by the guard
"""


@dataclass
class Run:
    """A finished child pytest: each test's outcome and message, and what it wrote."""

    returncode: int
    output: str
    seconds: float
    outcomes: dict[str, tuple[str, str]]
    marks: set[str]

    def outcome(self, name: str) -> tuple[str, str]:
        assert name in self.outcomes, self.output[-4000:]
        return self.outcomes[name]


def run_pytest(folder: Path, tests: str, *args: str, grace: float = 5) -> Run:
    """Run ``tests`` in a child pytest with pytest-timeout and the guard (``timeout_grace``
    seconds), no other plugins."""
    marks = folder / "marks"
    marks.mkdir()
    (folder / "test_generated.py").write_text(PRELUDE + tests)
    (folder / "pytest.ini").write_text(f"[pytest]\ntimeout_grace = {grace}\n")
    report = folder / "report.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "ALARM_MARKS": str(marks),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "pytest_timeout",
        "-p",
        "helpers.timeouts.guard",
        "-c",
        str(folder / "pytest.ini"),
        "--rootdir",
        str(folder),
        f"--junitxml={report}",
        *args,
        str(folder / "test_generated.py"),
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=90, check=False
    )
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    outcomes = _outcomes(report) if report.exists() else {}
    return Run(done.returncode, output, seconds, outcomes, {p.name for p in marks.iterdir()})


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        found = [c for c in case if c.tag in ("failure", "error", "skipped")]
        kind = found[0].tag if found else "passed"
        message = found[0].get("message", "") if found else ""
        out[case.get("name", "")] = (kind, message)
    return out


TIMEOUT_60 = "Timeout (>60.0s) from pytest-timeout."


@pytest.mark.unit
def test_the_suite_runs_with_the_guard(pytestconfig: pytest.Config) -> None:
    guard = pytestconfig.pluginmanager.get_plugin("timeout-guard")
    assert isinstance(guard, TimeoutGuard)
    assert guard.grace == 60


@pytest.fixture(scope="module")
def landings(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The tests whose alarm is dropped, run once for this file."""
    return run_pytest(tmp_path_factory.mktemp("landings"), LANDINGS)


@pytest.mark.parametrize(
    "name, mark",
    [
        ("test_alarm_in_gc_callback", "gc_callback"),
        ("test_alarm_in_del", "del"),
        ("test_alarm_in_del_func_only", "del_func_only"),
        ("test_alarm_in_weakref_callback", "weakref"),
        ("test_alarm_in_bare_except", "bare_except"),
    ],
)
def test_a_test_that_returns_after_its_alarm_was_dropped_fails(
    landings: Run, name: str, mark: str
) -> None:
    assert mark in landings.marks  # the alarm came where the test meant it to
    kind, message = landings.outcome(name)
    assert kind == "failure", message
    assert message.startswith(f"Failed: {TIMEOUT_60} The alarm landed in land_alarm"), message
    assert "went on: it ended" in message


def test_a_test_that_runs_on_after_its_alarm_was_dropped_gets_it_again(landings: Run) -> None:
    assert "then_loops" in landings.marks
    kind, message = landings.outcome("test_alarm_in_del_then_loops")
    assert kind == "failure", message
    assert message.startswith(f"Failed: {TIMEOUT_60} Raised again"), message


def test_an_alarm_dropped_in_setup_fails_the_setup_and_the_body_never_runs(
    landings: Run,
) -> None:
    assert "setup" in landings.marks
    kind, message = landings.outcome("test_alarm_in_setup")
    assert kind == "error", message
    assert TIMEOUT_60 in message
    assert "body_ran" not in landings.marks
    assert "teardown_ran" in landings.marks  # the fixture was made: it is torn down


def test_a_test_that_fails_on_its_own_keeps_its_failure(landings: Run) -> None:
    kind, message = landings.outcome("test_fails_on_its_own")
    assert kind == "failure"
    assert "its own failure" in message and "Timeout" not in message
    kind, message = landings.outcome("test_alarm_in_del_then_own_failure")
    assert kind == "failure"
    assert "its own failure after the alarm" in message, message
    assert re.search(r"-+ Timeout -+\n.*Timeout \(>60\.0s\)", landings.output), landings.output


def test_cleanup_after_an_alarm_that_was_not_dropped_is_not_interrupted(landings: Run) -> None:
    assert {"cleanup_started", "cleanup_done"} <= landings.marks
    kind, message = landings.outcome("test_cleanup_after_the_alarm_runs_to_its_end")
    assert kind == "failure"
    assert message == f"Failed: {TIMEOUT_60}"  # the one alarm, never raised again


def test_a_real_deadline_that_lands_in_a_del_fails(landings: Run) -> None:
    kind, message = landings.outcome("test_real_deadline_in_del")
    assert kind == "failure"
    assert message.startswith("Failed: Timeout (>1.0s) from pytest-timeout."), message


def test_tests_in_time_pass_before_and_after_the_alarms(landings: Run) -> None:
    assert landings.outcome("test_passes") == ("passed", "")
    assert landings.outcome("test_passes_after_the_alarms") == ("passed", "")
    assert len(landings.outcomes) == 13, landings.outcomes


def test_a_test_that_drops_every_alarm_ends_the_process(tmp_path: Path) -> None:
    run = run_pytest(tmp_path, SWALLOWS, grace=1)
    assert "swallowed" in run.marks
    assert run.returncode == 1, run.output[-4000:]
    assert "test_generated.py::test_keeps_swallowing FAILED: " + TIMEOUT_60 in run.output
    assert "the stuck test's output" in run.output
    assert "in __del__" in run.output  # the stacks
    assert run.seconds < 60


def test_under_xdist_the_test_that_drops_every_alarm_fails_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    run = run_pytest(tmp_path, SWALLOWS, "-p", "xdist.plugin", "-n", "1", grace=1)
    assert run.returncode == 1, run.output[-4000:]
    # xdist's report of a worker that ended (JUnit calls it an error at setup)
    crashed = "worker 'gw0' crashed while running 'test_generated.py::test_keeps_swallowing'"
    assert f"FAILED test_generated.py::test_keeps_swallowing - {crashed[:20]}" in run.output
    assert run.outcome("test_keeps_swallowing")[1] == f'failed on setup with "{crashed}"'
    assert "test_keeps_swallowing FAILED: " + TIMEOUT_60 in run.output  # the worker's words
    assert run.outcome("test_after_the_stuck_one") == ("passed", "")  # on a new worker


def test_a_test_stuck_in_c_after_its_alarm_ends_the_process(tmp_path: Path) -> None:
    run = run_pytest(tmp_path, STUCK_IN_C, grace=1)
    assert "c" in run.marks
    assert run.returncode == 1, run.output[-4000:]
    assert "Timeout (0:00:02)!" in run.output  # faulthandler's
    assert "in test_stuck_in_c" in run.output
    assert run.seconds < 60
