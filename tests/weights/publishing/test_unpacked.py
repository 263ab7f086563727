"""A publisher's small, separately allocated tensors written as they are to subscribers whose
connections copy in the kernel (cross-memory attach with a process of this machine), and through
the pack to the others, which is filled for a version only when such a write reads it: real NIXL
agents in processes of their own, every byte checked, and a late joiner's pull() of the tensors
themselves."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import transport
from helpers import internals
from helpers.child import START_TIMEOUT, ChildProcess, serve
from helpers.loopback_net import pattern
from helpers.polling import wait_until
from transport.weights.publishing.pack import UNPACKED_MAX_TENSORS, packable

pytestmark = [pytest.mark.timeout(240)]

DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float16, torch.int64, torch.bool)


def loose(n: int = 300) -> dict[str, torch.Tensor]:
    """``n`` separately allocated tensors of mixed dtypes and shapes (a model's norms, biases
    and small projections), zero-filled."""
    return {
        f"layers.{i // 4}.t{i % 4}": torch.zeros((3, 1 + i % 11), dtype=DTYPES[i % len(DTYPES)])
        for i in range(n)
    }


def fill(tensors: dict[str, torch.Tensor], version: int) -> None:
    """A pattern of each tensor's own for ``version`` (as an optimizer steps, in place)."""
    for i, t in enumerate(tensors.values()):
        seed = version * 1000 + i
        if t.dtype == torch.bool:  # a bool's byte is 0 or 1: a copy may normalize others
            t.view(-1).copy_(pattern(t.numel(), seed) % 2 == 1)
        else:
            t.view(-1).copy_(pattern(t.numel(), seed, t.dtype))


def as_bytes(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {
        n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()
    }


def _child(conn: Any, name: str, store: str, join: bool) -> None:
    """A subscriber (``join``) or a late joiner that only pulls, over zero-filled ``loose()``."""
    try:
        t = transport.Transport(name, store=store, timeout=60)
        sub = transport.WeightSubscriber(t, loose()) if join else None
    except BaseException as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", (t.generation, os.getpid())))

    def version(v: int) -> dict[str, bytes]:
        assert sub is not None
        sub.wait_for_version(v, timeout=60)
        sub.apply()
        return as_bytes(sub.live)

    def pull() -> tuple[int, dict[str, bytes]]:
        late = transport.WeightSubscriber(t, loose())
        try:
            got = late.pull("trainer", timeout=60)
            return got, as_bytes(late.live)
        finally:
            late.close()

    def close() -> None:
        if sub is not None:
            sub.close()
        t.close()

    serve(conn, {"version": version, "pull": pull}, close)


class Child(ChildProcess):
    def __init__(self, name: str, store: str, join: bool = True) -> None:
        super().__init__(name, _child, (store, join), START_TIMEOUT, wait=False)


@pytest.mark.parametrize("kept_to_nixl", [False, True], ids=["all-kernel", "one-kept-to-nixl"])
def test_loose_tensors_go_as_they_are_where_the_kernel_copies_and_a_late_joiner_pulls_them_whole(
    tcp_store, trainer, monkeypatch, kept_to_nixl
):
    weights = loose()
    assert len(packable(weights)) == len(weights)  # without this path they would all be packed
    url = tcp_store.url
    subs = [Child("gen0", url)]
    if kept_to_nixl:
        monkeypatch.setenv("TRANSPORT_CMA", "0")  # the child takes the environment of its start
    subs.append(Child("gen1", url))
    monkeypatch.delenv("TRANSPORT_CMA", raising=False)
    try:
        for s in subs:
            s.started(START_TIMEOUT)
        pub = transport.WeightPublisher(trainer, weights)
        try:
            wait_until(lambda: (pub.refresh(), len(pub.subscribers()))[1] == 2, 60, "2 joined")
            assert internals.unpacked_members(pub) == {"gen0": True, "gen1": not kept_to_nixl}
            for v in (1, 2, 3):
                with pub.updating():
                    fill(weights, v)
                result = pub.publish(v, timeout=60).wait(90)
                assert result.status == {"gen0": "done", "gen1": "done"}, result
                for s in subs:
                    s.begin("version", v)
                want = as_bytes(weights)
                for s in subs:
                    got = s.end("version", timeout=90)
                    bad = [n for n in want if got[n] != want[n]]
                    assert not bad, f"{s.name}, version {v}: {len(bad)} tensors differ ({bad[:3]})"
            # a late joiner reads version 3 from the tensors themselves (the pack, filled only
            # for a write that reads it, may hold none)
            with Child("late", url, join=False) as late:
                late.started(START_TIMEOUT)
                got_version, got = late.call("pull", timeout=90)
            assert got_version == 3
            assert got == as_bytes(weights)
        finally:
            pub.close()
    finally:
        for s in subs:
            s.stop()


def test_more_small_tensors_than_the_bound_go_through_the_pack(tcp_store, trainer):
    """Past UNPACKED_MAX_TENSORS each tensor's registration and plan row would cost more than
    the pack's one copy (and crowd out the Transport's budget of implicit registrations): the
    pack is written, and filled at every publish for pull()."""
    weights = loose(UNPACKED_MAX_TENSORS + 1)
    with transport.Transport("gen", store=tcp_store) as gen:
        sub = transport.WeightSubscriber(gen, loose(UNPACKED_MAX_TENSORS + 1))
        pub = transport.WeightPublisher(trainer, weights)
        try:
            wait_until(lambda: (pub.refresh(), len(pub.subscribers()))[1] == 1, 60, "gen joined")
            assert internals.unpacked_members(pub) == {"gen": False}
            with pub.updating():
                fill(weights, 1)
            assert pub.publish(1, timeout=60).wait(90).status == {"gen": "done"}
            sub.wait_for_version(1, timeout=60)
            sub.apply()
            assert as_bytes(sub.live) == as_bytes(weights)
        finally:
            pub.close()
            sub.close()
