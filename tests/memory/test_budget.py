"""The budget of registered host memory: past it a call fails with RegistrationBudgetError that
says how to raise it, and registers nothing; idle cached registrations make room first; views of
one buffer cost one registration."""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.loopback_net import LoopbackNet, pattern
from transport.backends.loopback import LoopbackBackend
from transport.memory.local import default_budget

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KiB = 1 << 10


def regions_seen(net: LoopbackNet, t: transport.Transport) -> int:
    """How many regions ``t``'s record in the store lists."""
    return next(p.regions for p in t.peers() if p.name == t.name)


def test_an_expose_past_the_budget_registers_nothing_and_says_how_to_raise_it(
    loopback_net: LoopbackNet,
):
    t = loopback_net.make("gen", max_registered_bytes=1024 * KiB)
    with pytest.raises(transport.RegistrationBudgetError) as e:
        t.expose_all({f"w{i}": torch.zeros(128 * KiB) for i in range(3)})  # 1.5 MiB of float32
    for words in (
        "max_registered_bytes",
        "TRANSPORT_MAX_REGISTERED_BYTES",
        "'w0'",
        "1048576",
        "Nothing of this call was registered",
    ):
        assert words in str(e.value)
    assert len(internals.local_memory(t)) == 0 and t.regions() == {}
    # exactly the budget fits; one byte more does not, and what was exposed stays
    a, b = torch.zeros(128 * KiB), torch.zeros(128 * KiB)
    t.expose_all({"a": a, "b": b})
    with pytest.raises(transport.RegistrationBudgetError):
        t.expose("c", torch.zeros(1, dtype=torch.uint8))
    assert sorted(t.regions()) == ["a", "b"] and regions_seen(loopback_net, t) == 2
    w = loopback_net.make("trainer")
    src = pattern(128 * KiB, 1, torch.float32)
    w.put(src, t.name, "b").wait(10)
    assert torch.equal(b, src)
    # unexposing gives the room back
    t.unexpose("a", timeout=5)
    t.expose("c", torch.zeros(1, dtype=torch.uint8))


def test_views_of_one_buffer_are_one_registration_within_the_budget(loopback_net: LoopbackNet):
    t = loopback_net.make("gen", max_registered_bytes=1024 * KiB)
    flat = torch.zeros(256 * KiB)  # exactly the budget
    views = {f"w{i}": flat[i * 1024 : (i + 1) * 1024] for i in range(256)}
    t.expose_all(views)
    assert len(internals.local_memory(t)) == 1 and len(t.regions()) == 256


def test_a_backend_failure_midway_leaves_nothing_registered(
    loopback_net: LoopbackNet, monkeypatch: pytest.MonkeyPatch
):
    t = loopback_net.make("gen")
    real, calls = LoopbackBackend.register, []

    def third_fails(self: LoopbackBackend, addr: int, nbytes: int, device: str) -> object:
        calls.append(addr)
        if len(calls) == 3:
            raise transport.BackendError("registration refused (a test)")
        return real(self, addr, nbytes, device)

    monkeypatch.setattr(LoopbackBackend, "register", third_fails)
    backend = internals.backend(t)
    with pytest.raises(transport.BackendError, match="a test"):
        t.expose_all({f"w{i}": torch.zeros(64) for i in range(5)})
    assert len(calls) == 3 and backend.regions == {}
    assert len(internals.local_memory(t)) == 0 and t.regions() == {}


def test_idle_cached_registrations_make_room_and_a_put_past_the_budget_fails(
    loopback_net: LoopbackNet,
):
    dst, big = torch.zeros(160 * KiB), torch.zeros(300 * KiB)
    g = loopback_net.receiver("gen", {"x": dst, "big": big})
    t = loopback_net.make("trainer", max_registered_bytes=1024 * KiB)
    for seed in (1, 2, 3):  # 640 KiB each: the one before (its plan idle) must go for the next
        src = pattern(160 * KiB, seed, torch.float32)
        t.put(src, g.name, "x").wait(10)
        assert torch.equal(dst, src)
    assert len(internals.local_memory(t)) == 1
    with pytest.raises(transport.RegistrationBudgetError, match="max_registered_bytes"):
        t.put(torch.ones(300 * KiB), g.name, "big")  # 1.2 MiB: over the budget alone
    assert torch.equal(big, torch.zeros(300 * KiB))


def test_budget_settings_are_checked(loopback_net: LoopbackNet, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="max_registered_bytes must be a positive int"):
        loopback_net.make("a", max_registered_bytes=0)
    monkeypatch.setenv("TRANSPORT_MAX_REGISTERED_BYTES", "lots")
    with pytest.raises(ValueError, match="TRANSPORT_MAX_REGISTERED_BYTES='lots'"):
        default_budget()
    monkeypatch.setenv("TRANSPORT_MAX_REGISTERED_BYTES", "4096")
    assert default_budget() == 4096
    monkeypatch.delenv("TRANSPORT_MAX_REGISTERED_BYTES")
    assert 0 < default_budget() < 1 << 60
