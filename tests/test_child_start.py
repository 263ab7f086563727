"""The test children (helpers.child) fork from a server that imported torch and ``transport``
already: a child that imported them again would cost the suite seconds per child, silently (an
import the forkserver fails is skipped)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from helpers.child import ChildProcess

pytestmark = pytest.mark.unit


def _report(conn: Any, name: str) -> None:
    preloaded = [m for m in ("torch", "transport", "transport.weights") if m in sys.modules]
    conn.send(("ok", (0, os.getpid())))
    conn.recv()
    conn.send(("ok", (preloaded, os.environ.get("TRANSPORT_TEST_CHILD_ENV"))))


def test_a_child_starts_with_torch_and_transport_imported_and_the_parents_environment(
    monkeypatch,
):
    monkeypatch.setenv("TRANSPORT_TEST_CHILD_ENV", "as the parent had it at the start")
    with ChildProcess("probe", _report, (), start_timeout=60) as child:
        preloaded, env = child.call("report")
    assert preloaded == ["torch", "transport", "transport.weights"]
    assert env == "as the parent had it at the start"
