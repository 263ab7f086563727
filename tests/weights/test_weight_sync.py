"""Weight sync between a publisher and subscriber processes: versions, every byte of them, tensors
that do not match, apply() never showing a mixed version, on_update, bad input.

In every test every element of every tensor of version N holds N, so a subscriber's per-tensor
(smallest, largest) element equal to (N, N) means every byte of version N arrived."""

from __future__ import annotations

import threading

import pytest
import torch

import transport
from helpers.polling import wait_until
from helpers.ws_peer import MiB, make_tensors, spec_of
from transport.weights.group.messages import Abort, Hello, Ver, encode
from transport.weights.group.region_names import channel

# Tensors of several dtypes and shapes; the inplace subscriber takes a subset of them.
SPEC = {
    "embed": ((256, 64), "float32"),
    "layers.0.w": ((128 * 1024,), "bfloat16"),
    "layers.0.b": ((100,), "float16"),
    "layers.1.w": ((3, 5, 7), "float64"),
    "step": ((1,), "int64"),
    "mask": ((4096,), "uint8"),
}
SUBSET = ("layers.0.w", "step", "mask")


def everywhere(names, value):
    return {n: (float(value), float(value)) for n in names}


def fill(tensors, value):
    for t in tensors.values():
        t.fill_(value)


def test_versions_reach_a_staging_and_an_inplace_subscriber(trainer, spawn):
    staging = spawn("sub", "gen-staging", SPEC, mode="staging", wait=False)
    inplace = spawn("sub", "gen-inplace", {n: SPEC[n] for n in SUBSET}, mode="inplace", wait=False)
    staging.started()
    inplace.started()
    tensors = make_tensors(SPEC)
    with transport.WeightPublisher(trainer, tensors, group="policy") as pub:
        for v in range(1, 6):
            fill(tensors, v)
            r = pub.publish(v, timeout=20).wait(30)
            assert r.version == v
            assert r.status == {"gen-staging": "done", "gen-inplace": "done"}, r.reasons
            assert r.done == ["gen-inplace", "gen-staging"] and r.reasons == {}
            assert staging.call("wait_for_version", v, 10) == v
            assert inplace.call("wait_for_version", v, 10) == v
            # staging: the live tensors keep the applied version until apply()
            assert staging.call("live") == everywhere(SPEC, v - 1)
            assert staging.call("apply") == v
            assert staging.call("live") == everywhere(SPEC, v)
            assert staging.call("state") == {"version": v, "applied": v, "incomplete": None}
            # inplace: the live tensors are written directly, and only the names it took
            assert inplace.call("live") == everywhere(SUBSET, v)
            assert inplace.call("apply") == v
            assert inplace.call("state") == {"version": v, "applied": v, "incomplete": None}
        assert pub.subscribers() == ["gen-inplace", "gen-staging"]
        assert pub.refresh() == {}
    assert staging.call("violations") == []


def test_mismatched_subscribers_are_excluded_with_every_reason(trainer, spawn):
    pub_spec = {
        "a": ((64,), "float32"),
        "b": ((8, 8), "float32"),
        "c": ((16,), "float32"),
    }
    # wrong shapes of two names
    bad_shape = spawn(
        "sub",
        "bad-shape",
        {"a": ((32,), "float32"), "b": ((4, 16), "float32"), "c": ((16,), "float32")},
        wait=False,
    )
    # a name the publisher lacks, a wrong dtype, a wrong shape
    bad_names = spawn(
        "sub",
        "bad-names",
        {"zz": ((4,), "float32"), "b": ((8, 8), "float16"), "c": ((17,), "float32")},
        mode="inplace",
        wait=False,
    )
    good = spawn("sub", "good", {"a": pub_spec["a"], "c": pub_spec["c"]}, wait=False)
    for child in (bad_shape, bad_names, good):
        child.started()
    tensors = make_tensors(pub_spec)
    with transport.WeightPublisher(trainer, tensors) as pub:
        fill(tensors, 1)
        r = pub.publish(1, timeout=20).wait(30)
        assert r.status == {"bad-shape": "excluded", "bad-names": "excluded", "good": "done"}
        assert set(r.reasons) == {"bad-shape", "bad-names"}

        why = r.reasons["bad-shape"]
        assert "2 problems" in why, why
        assert "'a'" in why and "(32,)" in why and "(64,)" in why, why
        assert "'b'" in why and "(4, 16)" in why and "(8, 8)" in why, why
        assert "'c'" not in why, why

        why = r.reasons["bad-names"]
        assert "3 problems" in why, why
        assert "'zz'" in why and "no tensor of that name" in why, why
        assert "'b'" in why and "float16" in why, why
        assert "'c'" in why and "(17,)" in why, why
        assert "'a'" not in why, why

        assert pub.refresh() == r.reasons
        assert good.call("wait_for_version", 1, 10) == 1
        assert good.call("apply") == 1
        assert good.call("live") == everywhere(["a", "c"], 1)
        # nothing reached the excluded ones
        assert bad_shape.call("state") == {"version": -1, "applied": -1, "incomplete": None}
        assert bad_names.call("state") == {"version": -1, "applied": -1, "incomplete": None}
        assert bad_names.call("live") == everywhere(["zz", "b", "c"], 0)

        fill(tensors, 2)  # and they stay excluded, with the same reasons
        r2 = pub.publish(2, timeout=20).wait(30)
        assert r2.status == r.status and r2.reasons == r.reasons
        assert good.call("wait_for_version", 2, 10) == 2
        assert good.call("apply") == 2
        assert good.call("live") == everywhere(["a", "c"], 2)


def test_apply_never_shows_a_mixed_version(trainer, spawn):
    """A child applies and checks its live tensors in a tight loop while versions keep landing."""
    spec = spec_of(48, 16 * 1024)  # 48 tensors of 64 KiB: 3 MiB
    last = 30
    sub = spawn("sub", "gen-0", spec, mode="staging")
    tensors = make_tensors(spec)
    with transport.WeightPublisher(trainer, tensors) as pub:
        fill(tensors, 1)
        assert pub.publish(1, timeout=20).wait(30).status == {"gen-0": "done"}
        sub.call("wait_for_version", 1, 10)
        sub.call("snapshot_start", last, 60)
        statuses = []
        for v in range(2, last + 1):
            fill(tensors, v)
            statuses.append(pub.publish(v, timeout=20).wait(30).status)
            if v % 3 == 1:  # bursts of three versions, then the loop takes 300 more snapshots
                sub.call("wait_snapshots", 100 * v, 30)
        out = sub.call("snapshot_result", 60)
    assert statuses == [{"gen-0": "done"}] * (last - 1)
    assert not out["timed_out"], out
    assert out["mixed"] == 0, out["first_mixed"]
    assert out["backwards"] == 0
    assert out["final"] == last
    assert out["snapshots"] >= 2800, out["snapshots"]
    assert len(out["applied"]) >= 5, out["applied"]  # it did apply while versions kept coming
    assert sub.call("violations") == []
    assert sub.call("live") == everywhere(spec, last)


def test_on_update_fires_once_per_new_version(tcp_store, trainer):
    seen: list[tuple[int, int]] = []
    cond = threading.Condition()

    with transport.Transport("gen-cb", store=tcp_store, timeout=30) as t:

        def on_update(v: int) -> None:
            with cond:
                seen.append((v, sub.version))
                cond.notify_all()
            if v == 2:
                raise RuntimeError("a failing callback must not stop the next ones")

        sub = transport.WeightSubscriber(t, {"w": torch.zeros(1024)}, on_update=on_update)
        src = {"w": torch.zeros(1024)}
        with transport.WeightPublisher(trainer, src) as pub:
            for v in (1, 2, 3, 7):
                src["w"].fill_(v)
                assert pub.publish(v, timeout=20).wait(30).status == {"gen-cb": "done"}
                with cond:
                    assert cond.wait_for(lambda v=v: seen and seen[-1][0] == v, 10), seen
        assert [v for v, _ in seen] == [1, 2, 3, 7]
        assert all(at >= v for v, at in seen)  # the version is visible when the callback runs
        assert sub.apply() == 7
        assert torch.equal(sub.live["w"], torch.full((1024,), 7.0))
        sub.close()


def test_bad_input(tcp_store, trainer):
    with pytest.raises(ValueError, match="mode"):
        transport.WeightSubscriber(trainer, {"w": torch.zeros(4)}, mode="x")
    with pytest.raises(ValueError, match="contiguous"):
        transport.WeightSubscriber(trainer, {"w": torch.zeros(4, 8).t()})
    with pytest.raises(ValueError, match="contiguous"):
        transport.WeightPublisher(trainer, {"w": torch.zeros(4, 8)[:, ::2]})
    with pytest.raises(ValueError):
        transport.WeightPublisher(trainer, {})
    with pytest.raises(ValueError):
        transport.WeightSubscriber(trainer, {})
    with transport.WeightPublisher(trainer, {"w": torch.zeros(4)}) as pub:
        assert pub.publish(3, timeout=5).wait(5).status == {}  # nobody subscribes yet
        for bad in (3, 2, -1):
            with pytest.raises(ValueError, match="forward"):
                pub.publish(bad)
        with pytest.raises(TypeError):
            pub.publish(True)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            pub.publish(4.0)  # type: ignore[arg-type]
        assert pub.version == 3
        assert pub.publish(4, timeout=5).wait(5).version == 4


def test_a_subscriber_in_the_test_process_needs_no_children(tcp_store, trainer):
    """The same flow with both ends in one process (several Transports per process work)."""
    with transport.Transport("gen-local", store=tcp_store, timeout=30) as t:
        live = {"w": torch.zeros(2 * MiB // 4)}
        sub = transport.WeightSubscriber(t, live)
        src = {"w": torch.full((2 * MiB // 4,), 5.0)}
        with transport.WeightPublisher(trainer, src) as pub:
            assert pub.publish(5, timeout=20).wait(30).status == {"gen-local": "done"}
        assert sub.wait_for_version(5, 10) == 5
        assert torch.equal(live["w"], torch.zeros_like(live["w"]))
        assert sub.apply() == 5
        assert torch.equal(live["w"], src["w"])
        sub.close()


def test_a_subscriber_acts_only_on_its_groups_publisher(tcp_store, trainer, spawn):
    """A peer of the namespace that is not the group's publisher (nor a relay) forges a version
    announcement, an abort and a hello: the subscriber ignores all three, and the next real
    version arrives whole."""
    sub = spawn("sub", "gen-0", SPEC, mode="staging")
    tensors = make_tensors(SPEC)
    with (
        transport.WeightPublisher(trainer, tensors, group="policy") as pub,
        transport.Transport("mallory", store=tcp_store) as mallory,
    ):
        fill(tensors, 1)
        assert pub.publish(1, timeout=20).wait(30).status == {"gen-0": "done"}
        assert sub.call("wait_for_version", 1, 10) == 1
        for forged in (Ver(777, 0), Ver(778, 1), Abort(2, 0), Hello()):
            mallory.core.send_control("gen-0", channel("policy"), encode(forged))
        wait_until(lambda: sub.call("refused") >= 4, 30, "the subscriber refusing 4 messages")
        assert sub.call("state") == {"version": 1, "applied": -1, "incomplete": None}
        for v in (2, 3):
            fill(tensors, v)
            assert pub.publish(v, timeout=20).wait(30).status == {"gen-0": "done"}
            assert sub.call("wait_for_version", v, 10) == v
            assert sub.call("apply") == v
            assert sub.call("live") == everywhere(SPEC, v)
    assert sub.call("refused") == 4
