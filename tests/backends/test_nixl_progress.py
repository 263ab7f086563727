"""How a NIXL agent makes progress (backends/nixl.py): ``auto`` wakes on traffic only where UCX is
kept to network transports, where a small message waits for the receiver's wake-up; anything
but the three modes is refused naming them; the bench's across-hosts launcher passes every flag
on except its own."""

from __future__ import annotations

import pytest

from transport.backends.nixl import progress_mode
from transport.cli.bench.across import child_argv

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("tls", "mode"),
    [
        ("tcp", "events"),
        ("rc,tcp", "events"),
        ("", "poll"),
        ("tcp,cma", "poll"),
        ("sm,tcp", "poll"),
        ("^cma", "poll"),
        ("all", "poll"),
        ("TCP, posix", "poll"),
    ],
)
def test_auto_wakes_on_traffic_only_over_network_transports(tls, mode, monkeypatch):
    monkeypatch.delenv("TRANSPORT_PROGRESS", raising=False)
    assert progress_mode(None, tls) == mode
    assert progress_mode("auto", tls) == mode


def test_a_choice_beats_auto_and_the_environment_beats_the_default(monkeypatch):
    monkeypatch.setenv("TRANSPORT_PROGRESS", "poll")
    assert progress_mode(None, "tcp") == "poll"
    assert progress_mode("events", "") == "events"


@pytest.mark.parametrize("bad", ["fast", "", "EVENTS"])
def test_anything_else_is_refused_naming_the_modes(bad, monkeypatch):
    monkeypatch.delenv("TRANSPORT_PROGRESS", raising=False)
    with pytest.raises(ValueError, match="auto, events, poll"):
        progress_mode(bad)
    if bad:
        monkeypatch.setenv("TRANSPORT_PROGRESS", bad)
        with pytest.raises(ValueError, match=r"\$TRANSPORT_PROGRESS"):
            progress_mode(None)


def test_the_launcher_passes_every_flag_but_its_own():
    argv = ["bench", "put", "--link", "1gbit", "--sizes", "4K", "--link=2gbit", "--quick"]
    assert child_argv(argv) == ["bench", "put", "--sizes", "4K", "--quick"]
