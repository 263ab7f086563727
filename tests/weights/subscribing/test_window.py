"""A WindowedSubscriber (versions written in place, only while the engine waits in receive()),
against a real publisher in another process: nothing lands outside the window, a version
received whole holds every byte, a version torn mid-write is named until the next one lands.

Every element of every tensor of version N holds N, so per-tensor (smallest, largest) equal to
(N, N) means every byte of version N arrived."""

from __future__ import annotations

import signal

import pytest

from helpers.child import ChildError
from helpers.ws_peer import MiB

pytestmark = pytest.mark.timeout(180)

# hundreds of tensors, tens of MiB, of several dtypes (a model's shapes, small)
SPEC = {
    **{f"layers.{i}.w": ((256, 1024), "bfloat16") for i in range(48)},
    **{f"layers.{i}.b": ((1024,), "float32") for i in range(48)},
    "embed": ((8 * MiB // 4,), "float32"),
}


def whole(value: float) -> dict[str, tuple[float, float]]:
    return {n: (float(value), float(value)) for n in SPEC}


def test_versions_land_only_inside_receive(spawn):
    sub = spawn("sub", "gen-window", SPEC, mode="window")
    pub = spawn("pub", "trainer", SPEC)
    # no window: the publisher is never credited a slot, so at its deadline it excludes the
    # subscriber, and not a byte of the live tensors changed
    status, reasons = pub.call("publish", 1, 1.0, 3.0, 30.0)
    assert status == {"gen-window": "excluded"}, reasons
    assert sub.call("live") == whole(0)
    assert sub.call("state")["version"] == -1
    for version in (2, 3):
        pub.begin("publish", version, float(version), 60.0, 90.0)
        assert sub.call("receive", version, 60.0) == version
        assert pub.end("publish", 90)[0] == {"gen-window": "done"}
        assert sub.call("live") == whole(version)
        assert sub.call("torn") is None
    # the window shut when version 3 completed: version 4 waits for the next receive
    pub.begin("publish", 4, 4.0, 60.0, 90.0)
    with pytest.raises(ChildError, match="VersionGoneError: version 4 .* in place of version 5"):
        # the window opens for 5; the publisher, credited, writes its 4 there (the engine sees
        # the version it holds named)
        sub.call("receive", 5, 60.0)
    assert pub.end("publish", 90)[0] == {"gen-window": "done"}
    assert sub.call("live") == whole(4)
    assert sub.call("state")["version"] == 4


def test_a_version_torn_mid_write_is_named_until_the_next_one_lands(spawn):
    sub = spawn("sub", "gen-torn", SPEC, mode="window")
    first = spawn("pub", "trainer", SPEC)
    first.begin("publish", 1, 1.0, 60.0, 90.0)
    assert sub.call("receive", 1, 60.0) == 1
    assert first.end("publish", 90)[0] == {"gen-torn": "done"}
    # version 2's bytes go, its completion never does (the publisher is stuck, then killed)
    first.call("hold_notified_parts")
    first.call("publish_nowait", 2, 2.0, 60.0)
    with pytest.raises(ChildError, match="TransferTimeout: .* torn .*version 2 began"):
        sub.call("receive", 2, 15.0)
    assert sub.call("torn") == 2
    # what of version 2 landed is the publisher's business (it may post it as one transfer):
    # every tensor holds version 1, version 2 or parts of both, and it is named torn either way
    assert set(sub.call("live").values()) <= {(1.0, 1.0), (2.0, 2.0), (1.0, 2.0)}
    first.kill()
    assert first.proc.exitcode == -signal.SIGKILL
    # the trainer restarts (a new incarnation of the same name): its next version lands whole
    second = spawn("pub", "trainer", SPEC)
    second.begin("publish", 3, 3.0, 60.0, 90.0)
    assert sub.call("receive", 3, 60.0) == 3
    assert second.end("publish", 90)[0] == {"gen-torn": "done"}
    assert sub.call("live") == whole(3)
    assert sub.call("torn") is None
