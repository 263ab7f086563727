"""The plan cache of a Transport, through the public API on the loopback backend.

A put is planned once per (peer, source, region, offset) and replayed after that; these tests
check that replays move the new contents, that a region exposed later is found, that a small
``max_plans`` evicts without losing bytes, that ``unexpose`` stops later puts and keeps what
landed, and that every refused put names its rule and sends nothing.
"""

from __future__ import annotations

import pytest
import torch

import transport
from helpers import internals
from helpers.loopback_net import frozen, pattern
from transport.backends.loopback import LoopbackBackend

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


@pytest.fixture
def preps(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Every descriptor list the loopback backend prepares (one per side of each new plan), by
    target agent (None: local)."""
    calls: list[str | None] = []
    real = LoopbackBackend.prep

    def counting(self: LoopbackBackend, agent: str | None, descs: object, device: str) -> object:
        calls.append(agent)
        return real(self, agent, descs, device)

    monkeypatch.setattr(LoopbackBackend, "prep", counting)
    return calls


@pytest.mark.parametrize(
    ("nbytes", "options", "notify"),
    [
        (4096, {}, False),  # one part, posted by the caller
        (4096, {}, True),
        (1 << 16, {"chunk_bytes": 4096}, True),  # 16 parts, posted by the engine
        (1 << 16, {"inline_bytes": 0}, False),  # one part, posted by the engine
    ],
    ids=["inline", "inline-notify", "chunked-notify", "engine"],
)
def test_repeated_puts_replay_one_plan_and_move_the_new_bytes(
    loopback_net, preps, nbytes, options, notify
):
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w", **options)
    src = torch.empty(nbytes, dtype=torch.uint8)
    for seed in range(6):
        src.copy_(pattern(nbytes, seed))
        w.put(src, r.name, "dst", notify=b"v%d" % seed if notify else None).wait(5)
        assert torch.equal(dst, pattern(nbytes, seed))
        if notify:
            assert r.wait_notification(5, peer=w.name).payload == b"v%d" % seed
        if seed == 0:
            planned = len(preps)
            assert planned > 0
    assert len(preps) == planned, "a repeated put of the same tensor planned again"
    # every completed put counted, whichever thread posted it
    assert w.traffic() == {r.name: transport.PeerTraffic(6 * nbytes, 0)}


def test_a_get_replays_its_plan_and_reads_the_current_bytes(loopback_net, preps):
    region = pattern(8192, 1)
    r = loopback_net.receiver("r", {"src": region})
    w = loopback_net.make("w")
    dst = torch.zeros(8192, dtype=torch.uint8)
    w.get(dst, r.name, "src").wait(5)
    assert torch.equal(dst, pattern(8192, 1))
    planned = len(preps)
    for seed in range(2, 5):
        region.copy_(pattern(8192, seed))
        w.get(dst, r.name, "src").wait(5)
        assert torch.equal(dst, pattern(8192, seed))
    assert len(preps) == planned
    assert w.traffic() == {r.name: transport.PeerTraffic(0, 4 * 8192)}


def test_a_region_exposed_after_the_first_put_is_found(loopback_net):
    a, b = torch.zeros(4096, dtype=torch.uint8), torch.zeros(2048, dtype=torch.int32)
    r = loopback_net.receiver("r", {"a": a})
    w = loopback_net.make("w")
    w.put(pattern(4096, 1), r.name, "a").wait(5)  # w now holds r's record without "b"
    r.expose("b", b)
    w.put(pattern(2048, 2, torch.int32), r.name, "b").wait(5)  # no wait_for_peer: found anyway
    assert torch.equal(b, pattern(2048, 2, torch.int32))
    w.put({"a": pattern(4096, 3), "b": pattern(2048, 4, torch.int32)}, r.name).wait(5)
    assert torch.equal(a, pattern(4096, 3))
    assert torch.equal(b, pattern(2048, 4, torch.int32))


def test_a_region_exposed_later_is_found_by_a_fan_out(loopback_net):
    bufs = [torch.zeros(1024, dtype=torch.float32) for _ in range(2)]
    peers = [loopback_net.receiver(f"g{i}", {"old": torch.zeros(16)}) for i in range(2)]
    w = loopback_net.make("w")
    w.put(torch.ones(16), [p.name for p in peers], "old").wait(5)  # both records cached
    for p, buf in zip(peers, bufs, strict=True):
        p.expose("new", buf)
    src = pattern(1024, 5, torch.float32)
    w.put(src, [p.name for p in peers], "new").wait(5)
    assert all(torch.equal(buf, src) for buf in bufs)


def test_a_small_plan_cache_evicts_and_still_moves_every_tensor(loopback_net, preps):
    n, size = 40, 1024
    dst = torch.zeros(n * size, dtype=torch.int16)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    w.max_plans = 8
    sources = [torch.empty(size, dtype=torch.int16) for _ in range(n)]
    for round_ in range(2):
        for i, s in enumerate(sources):
            s.copy_(pattern(size, 100 * round_ + i, torch.int16))
            w.put(s, r.name, "dst", offset=i * size).wait(5)
        if round_ == 0:
            first_round = len(preps)
        for i in range(n):
            want = pattern(size, 100 * round_ + i, torch.int16)
            assert torch.equal(dst[i * size : (i + 1) * size], want), (round_, i)
    # 40 plans do not fit in 8: the second round planned again, at least for the evicted ones
    assert len(preps) > first_round


def test_eviction_skips_plans_in_flight(loopback_net):
    n, size = 12, 4096
    dst = torch.zeros(n * size, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    w.max_plans = 8
    w.put(pattern(size, 0), r.name, "dst").wait(5)  # connected
    sources = [pattern(size, 1 + i) for i in range(n)]
    with frozen(r):
        handles = [w.put(s, r.name, "dst", offset=i * size) for i, s in enumerate(sources)]
        assert not any(h.done() for h in handles)  # all held by the frozen receiver
    transport.wait_all(handles, timeout=5)
    for i, s in enumerate(sources):
        assert torch.equal(dst[i * size : (i + 1) * size], s), i


def test_eviction_keeps_the_plan_of_a_queued_transfer(loopback_net):
    # Sixteen small puts held by a frozen receiver fill the writer engine's window of posted
    # parts to it, so a chunked put to the same receiver waits in the engine's queue, not one
    # part posted, while puts of new tensors to another peer fill the plan cache past its size.
    r_big, r_small = torch.zeros(1 << 16, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    y_buf = torch.zeros(64 * 8, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"b": r_big, "s": r_small})
    y = loopback_net.receiver("y", {"s": y_buf})
    w = loopback_net.make("w", chunk_bytes=4096)
    w.max_plans = 8
    big, small = pattern(1 << 16, 7), pattern(64, 6)
    w.put(small, r.name, "s").wait(5)  # planned: the puts below are posted by this thread
    with frozen(r):
        held = [w.put(small, r.name, "s") for _ in range(16)]
        hr = w.put(big, r.name, "b")  # 16 parts, queued behind the held ones
        for i in range(10):
            w.put(pattern(64, 10 + i), y.name, "s", offset=64 * (i % 8)).wait(5)
        assert not hr.done()
    transport.wait_all(held, timeout=5)
    hr.wait(5)
    assert torch.equal(r_big, big) and torch.equal(r_small, small)
    assert torch.equal(y_buf[64 * 1 : 64 * 2], pattern(64, 19))


def test_a_fan_out_wider_than_max_plans_reaches_every_peer(loopback_net):
    bufs = [torch.zeros(256, dtype=torch.uint8) for _ in range(5)]
    peers = [loopback_net.receiver(f"g{i}", {"x": b}) for i, b in enumerate(bufs)]
    w = loopback_net.make("w")
    w.max_plans = 4
    src = pattern(256, 3)
    w.put(src, [p.name for p in peers], "x").wait(5)
    assert [torch.equal(b, src) for b in bufs] == [True] * 5


def test_unexpose_fails_later_puts_and_keeps_what_landed(loopback_net):
    a, b = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"a": a, "b": b})
    w = loopback_net.make("w")
    src = pattern(4096, 1)
    for _ in range(3):  # planned and replayed: a cached plan on the region
        w.put(src, r.name, "a").wait(5)
    assert torch.equal(a, pattern(4096, 1))
    assert r.unexpose("a", timeout=5) == []  # the writer confirmed
    assert set(r.regions()) == {"b"}
    with pytest.raises(
        transport.RegionError, match=r"has no region 'a'; it exposes 1 regions, e.g. 'b'"
    ):
        w.put(pattern(4096, 2), r.name, "a")
    with pytest.raises(transport.RegionError, match="has no region 'a'"):
        w.put({"a": pattern(4096, 3), "b": pattern(4096, 4)}, r.name)
    assert torch.equal(a, pattern(4096, 1)), "the withdrawn region changed"
    assert b.eq(0).all(), "a refused batch wrote part of itself"
    w.put(pattern(4096, 5), r.name, "b").wait(5)  # the other region is untouched
    assert torch.equal(b, pattern(4096, 5))


def test_unexpose_of_many_regions_at_once_writes_one_record_and_few_messages(loopback_net):
    """20,000 regions withdrawn together (as a weight subscriber's slots are at close): one
    record written, their names to the writer in a handful of messages, every plan on them
    stopped, the writer confirms all of them, and the regions kept are untouched."""
    n = 20_000
    flat = torch.zeros(n * 16, dtype=torch.uint8)
    keep = torch.zeros(4096, dtype=torch.uint8)
    views = {f"layers.{i}.w": flat[i * 16 : (i + 1) * 16] for i in range(n)}
    r = loopback_net.receiver("r", {"keep": keep, **views})
    w = loopback_net.make("w")
    w.put({k: pattern(16, 1) for k in list(views)[:3]}, r.name).wait(10)  # plans on a few
    before = internals.record_revision(r)
    sent = internals.count_control_messages(r, "tx/withdraw")
    assert r.unexpose(list(views), timeout=30) == []  # the writer confirmed every one
    assert internals.record_revision(r) == before + 1
    assert 1 <= sent() <= n // 1000
    assert set(r.regions()) == {"keep"}
    for name in ("layers.0.w", f"layers.{n - 1}.w"):
        with pytest.raises(transport.RegionError, match="has no region"):
            w.put(pattern(16, 2), r.name, name)
    w.put(pattern(4096, 3), r.name, "keep").wait(5)
    assert torch.equal(keep, pattern(4096, 3))
    with pytest.raises(KeyError, match="nothing was withdrawn"):
        r.unexpose(["keep", "layers.0.w"])
    assert set(r.regions()) == {"keep"}


def test_unexpose_asks_no_peer_that_closed_but_one_whose_record_is_only_missing(loopback_net):
    """A writer that closed (its record gone, its leave in the store) is not asked: a message to
    it would only make the backend log the loss. A writer whose record is merely missing (a
    store that restarted empty) is asked, and answers, before the memory is let go."""
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"a": a, "b": b})
    gone, alive = loopback_net.make("gone"), loopback_net.make("alive")
    for w in (gone, alive):
        w.put(pattern(64, 1), r.name, "a").wait(5)
        r.notify(w.name, b"hello")  # r holds a connection to each
        w.wait_notification(5)
    gone.close()
    loopback_net.store.delete(f"transport/{alive.namespace}/peers/{alive.name}")  # lost, alive
    sent = internals.count_control_messages(r, "tx/withdraw")
    assert r.unexpose("a", timeout=10) == []  # alive confirmed
    assert sent() == 1  # to alive only
    with pytest.raises(transport.RegionError):
        alive.put(pattern(64, 2), r.name, "a")
    assert torch.equal(a, pattern(64, 1))


def test_unexpose_with_no_writer_connected_and_a_new_region_under_the_old_name(loopback_net):
    a = torch.zeros(1024, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"a": a})
    w = loopback_net.make("w")
    assert r.unexpose("a", timeout=5) == []
    with pytest.raises(transport.RegionError, match="no region 'a'; it exposes no regions yet"):
        w.put(pattern(1024, 1), r.name, "a")
    a2 = torch.zeros(2048, dtype=torch.uint8)
    r.expose("a", a2)  # the name is free again, for new memory
    w.put(pattern(2048, 2), r.name, "a").wait(5)
    assert torch.equal(a2, pattern(2048, 2))
    assert a.eq(0).all()


@pytest.mark.parametrize(
    ("call", "error", "rule"),
    [
        (
            lambda w, p: w.put(torch.ones(64, dtype=torch.float32), p, "u8"),
            transport.RegionError,
            r"dtype mismatch for region 'u8' of peer '.*-r': the tensor is float32, the region is "
            r"uint8; convert with \.to\(torch\.uint8\)",
        ),
        (
            lambda w, p: w.put(torch.ones(1025, dtype=torch.uint8), p, "u8"),
            transport.RegionError,
            r"1025 elements at offset 0 do not fit region 'u8'.*\(1024 elements of uint8",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p, "u8", offset=1020),
            transport.RegionError,
            "8 elements at offset 1020 do not fit region 'u8'",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p, "nope"),
            transport.RegionError,
            r"has no region 'nope'; it exposes 3 regions, e\.g\. 'u8', 'ro'",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p, "ro"),
            transport.RegionError,
            r"exposes region 'ro' read-only \(access='r'\); it cannot be written",
        ),
        (
            lambda w, p: w.get(torch.ones(8, dtype=torch.uint8), p, "wo"),
            transport.RegionError,
            r"exposes region 'wo' write-only \(access='w'\); it cannot be read",
        ),
        (
            lambda w, p: w.put(torch.ones(8, 8, dtype=torch.uint8).t(), p, "u8"),
            ValueError,
            r"not contiguous; call \.contiguous\(\)",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p, "u8", offset=-1),
            ValueError,
            "offset must be a non-negative int",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p),
            ValueError,
            "no key given.*pass key='region' or call register",
        ),
        (
            lambda w, p: w.put({"u8": torch.ones(8, dtype=torch.uint8)}, p, "u8"),
            ValueError,
            "key= cannot be combined with a dict",
        ),
        (lambda w, p: w.put({}, p), ValueError, "the dict of tensors is empty"),
        (
            lambda w, p: w.put(
                {"u8": torch.ones(8, dtype=torch.uint8), "ro": torch.ones(8, dtype=torch.uint8)}, p
            ),
            transport.RegionError,
            "exposes region 'ro' read-only",
        ),
        (
            lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), p + "-nobody", "u8"),
            transport.PeerNotFoundError,
            r"no peer named '.*-r-nobody' in namespace 'default' \(known peers: .*-r",
        ),
        (lambda w, p: w.put(torch.ones(8, dtype=torch.uint8), 7, "u8"), TypeError, "peer"),
        (lambda w, p: w.put([1, 2], p, "u8"), TypeError, "expected a torch.Tensor, a dict"),
    ],
    ids=[
        "dtype",
        "size",
        "offset-size",
        "unknown-region",
        "read-only",
        "write-only",
        "non-contiguous",
        "negative-offset",
        "no-key",
        "key-and-dict",
        "empty-dict",
        "batch-with-one-bad",
        "unknown-peer",
        "peer-type",
        "source-type",
    ],
)
def test_a_refused_transfer_names_its_rule_and_sends_nothing(loopback_net, call, error, rule):
    regions = {
        "u8": pattern(1024, 1),
        "ro": pattern(64, 2),
        "wo": pattern(64, 3),
    }
    r = loopback_net.make("r")
    r.expose("u8", regions["u8"])
    r.expose("ro", regions["ro"], access="r")
    r.expose("wo", regions["wo"], access="w")
    w = loopback_net.make("w")
    w.put(pattern(1024, 1), r.name, "u8").wait(5)  # connected, one plan cached
    with pytest.raises(error, match=rule):
        call(w, r.name)
    for name, seed, n in (("u8", 1, 1024), ("ro", 2, 64), ("wo", 3, 64)):
        assert torch.equal(regions[name], pattern(n, seed)), name
    # the refusal left the writer usable
    w.put(pattern(1024, 9), r.name, "u8").wait(5)
    assert torch.equal(regions["u8"], pattern(1024, 9))


def test_a_cached_plan_does_not_let_another_dtype_of_the_same_memory_through(loopback_net):
    dst = torch.zeros(1024, dtype=torch.uint8)
    r = loopback_net.receiver("r", {"dst": dst})
    w = loopback_net.make("w")
    src = pattern(1024, 1)
    w.put(src, r.name, "dst").wait(5)  # the plan of (src's memory, uint8) is cached
    with pytest.raises(transport.RegionError, match="the tensor is int8, the region is uint8"):
        w.put(src.view(torch.int8), r.name, "dst")  # same pointer and size, another dtype
    with pytest.raises(transport.RegionError, match="do not fit region 'dst'"):
        w.put(src, r.name, "dst", offset=1)  # same source, an offset it no longer fits at
    assert torch.equal(dst, pattern(1024, 1))


def test_a_put_without_key_uses_the_registered_name(loopback_net):
    dst = torch.zeros(512, dtype=torch.float64)
    r = loopback_net.receiver("r", {"layers.0.w": dst})
    w = loopback_net.make("w")
    src = torch.empty(512, dtype=torch.float64)
    w.register(src, name="layers.0.w")
    for seed in range(3):
        src.copy_(pattern(512, seed, torch.float64))
        w.put(src, r.name).wait(5)
        assert torch.equal(dst, pattern(512, seed, torch.float64))
