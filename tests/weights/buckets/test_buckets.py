"""The verl engine's bucket protocol on the loopback backend: packing and headers (every rule of
a header a peer wrote), trainer ranks sharing the sending, relays, a receiver slower than the
sender (double buffering: a slot in use is never written), and a receiver that goes away."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch

from helpers.loopback_net import pattern
from helpers.polling import wait_until
from transport import (
    Handle,
    TransportError,
    UpdateAbortedError,
    UpdateSupersededError,
    WireFormatError,
)
from transport.weights.buckets.buckets import (
    ALIGN,
    Assembler,
    BucketPiece,
    Packer,
    Planned,
    read_header,
)
from transport.weights.buckets.changes import PieceCopies
from transport.weights.buckets.inbox import Inbox
from transport.weights.buckets.messages import Begun, Bucket, Free, Stop, decode, encode
from transport.weights.buckets.receiver import BucketReceiver
from transport.weights.buckets.sender import BucketSender
from transport.weights.buckets.targets import SLOTS
from transport.weights.buckets.topology import EngineInfo, build_plans
from transport.weights.delta.policy import DeltaPolicy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

KIB = 1024


def model(count: int = 120, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of the shapes and dtypes of a small transformer, a large one, odd sizes, a
    zero-size one and a scalar."""
    out: dict[str, torch.Tensor] = {}
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8]
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        n = [1, 7, 300, 1000, 4099, 17][i % 6] * (1 + i % 5)
        t = pattern(n, seed * 1000 + i, torch.uint8 if dtype == torch.bool else dtype)
        out[f"model.layers.{i}.w"] = (t % 2).bool() if dtype == torch.bool else t
    out["lm_head.weight"] = pattern(150 * KIB, seed + 7, torch.float32).view(300, 512)  # > a bucket
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    out["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    return out


def unpack_all(weights: dict[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
    """Pack ``weights`` and read every bucket back the way a receiver does."""
    packer = Packer(bucket)
    buf = torch.zeros(bucket, dtype=torch.uint8)
    asm = Assembler("cpu")
    got: dict[str, torch.Tensor] = {}

    def read(planned: Planned) -> None:
        assert planned.nbytes <= bucket
        buf[planned.header_at : planned.nbytes] = torch.frombuffer(
            bytearray(planned.header), dtype=torch.uint8
        )
        pieces = read_header(
            bytes(buf[planned.header_at : planned.nbytes].numpy()), planned.data_bytes
        )
        for name, t in asm.tensors(buf, pieces):
            got[name] = t.clone()

    for name, t in weights.items():
        for item in packer.add(name, t):
            if isinstance(item, Planned):
                read(item)
            else:
                piece, data = item
                buf[piece.offset : piece.offset + piece.nbytes] = data
    read(packer.finish())
    asm.check_complete()
    return got


def test_packing_and_reading_back_gives_every_tensor_bit_for_bit() -> None:
    weights = model()
    got = unpack_all(weights, 64 * KIB)
    assert list(got) == list(weights)
    for name, t in weights.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_a_header_that_breaks_a_rule_is_refused_naming_the_tensor() -> None:
    good = ["w", "float32", [4], 0, 16, 0]
    assert read_header(msgpack.packb([good]), 16) == [BucketPiece("w", "float32", (4,), 0, 16, 0)]
    cases = {
        "dtype 'complex'": ["w", "complex", [4], 0, 16, 0],
        "not an aligned run": ["w", "float32", [4], ALIGN // 2, 16, 0],
        "inside the bucket's 16 bytes": ["w", "float32", [8], 0, 32, 0],
        "lies outside its 16 bytes": ["w", "float32", [4], 0, 16, 8],
        "not a list of ints": ["w", "float32", [-1], 0, 0, 0],
        "offset must be an int": ["w", "float32", [4], "0", 16, 0],
        "1 to 1024 characters": ["", "float32", [4], 0, 16, 0],
        "has 6 fields": ["w", "float32", [4], 0, 16],
    }
    for rule, row in cases.items():
        with pytest.raises(WireFormatError, match=rule):
            read_header(msgpack.packb([row]), 16 if "32" not in str(row) else 16)
    with pytest.raises(WireFormatError, match="not valid msgpack"):
        read_header(b"\xc1garbage", 16)


def test_a_tensor_that_changes_shape_or_is_cut_short_is_refused_with_its_name() -> None:
    asm = Assembler("cpu")
    bucket = torch.zeros(256, dtype=torch.uint8)
    list(asm.tensors(bucket, [BucketPiece("q_proj", "bfloat16", (4, 8), 0, 64, 0)]))
    with pytest.raises(
        WireFormatError, match=r"q_proj arrived as bfloat16\[8, 4\] but was bfloat16\[4, 8\]"
    ):
        list(asm.tensors(bucket, [BucketPiece("q_proj", "bfloat16", (8, 4), 0, 64, 0)]))
    asm.begin()
    list(asm.tensors(bucket, [BucketPiece("big", "uint8", (100,), 0, 64, 0)]))
    with pytest.raises(WireFormatError, match="big stopped at byte 64 of 100 and other"):
        list(asm.tensors(bucket, [BucketPiece("other", "uint8", (4,), 0, 4, 0)]))
    asm.begin()
    list(asm.tensors(bucket, [BucketPiece("big", "uint8", (100,), 0, 64, 0)]))
    with pytest.raises(WireFormatError, match="ended with tensor big at byte 64 of 100"):
        asm.check_complete()


def test_messages_round_trip_and_garbage_is_refused() -> None:
    token = "0123456789abcdef"
    for msg in (
        Bucket(token, 3, 1, 100, 128, 40, False),
        Bucket(token, 4, 0, 100, 64, 40, True, 60),
        Free(token, 5),
        Begun(token),
        Stop(token, "why", True),
    ):
        assert decode(encode(msg)) == msg
    bucket = {"t": token, "i": 0, "s": 0, "n": 0, "h": 0, "hn": 0, "l": False, "c": 0}
    for bad, rule in (
        (msgpack.packb({"k": "free", "t": token}), "malformed"),
        (msgpack.packb({"k": "free", "t": "xyz", "i": 1}), "16 hex digits"),
        (msgpack.packb({"k": "free", "t": token, "i": -1}), "non-negative"),
        (msgpack.packb({"k": "free", "t": 7, "i": 1}), "must be a str"),
        (msgpack.packb({"k": "bucket", **bucket, "s": 2}), "slot is 0 or 1"),
        (msgpack.packb({"k": "bucket", **bucket, "c": -1}), "non-negative"),
        (msgpack.packb({"k": "bucket", **bucket, "l": 0}), "must be a bool"),
        (msgpack.packb({"k": "stop", "t": token, "e": b"x", "w": True}), "must be a str"),
        (msgpack.packb({"k": "nope"}), "malformed"),
        (msgpack.packb({"kind": "free", "token": token, "index": 1}), "malformed"),
        (b"\x00" * 9000, "limit"),
    ):
        with pytest.raises(WireFormatError, match=rule):
            decode(bad)


# -- the protocol between loopback Transports --------------------------------------------------


class Job:
    """Trainer ranks and rollout workers of one update on loopback Transports, wired as the
    engine wires them (plans from build_plans, slots exposed, send buffers registered; with
    ``copies``, one per engine, kept across jobs: delta buckets)."""

    def __init__(
        self,
        net,
        trainers: int,
        rollouts: int,
        bucket: int,
        degree: int = 0,
        copies: list[PieceCopies] | None = None,
        prefix: str = "",
        policies: list[DeltaPolicy] | None = None,
    ) -> None:
        self.bucket = bucket
        self.trainers, self.degree, self.copies = trainers, degree, copies
        self.t = []
        for i in range(trainers + rollouts):
            t = net.make(f"{prefix}{'t' if i < trainers else 'r'}{i}", heartbeat_interval=0.2)
            self.t.append(t)
        self.inbox = [Inbox(t) for t in self.t]
        self.buffers = [
            [torch.empty(bucket, dtype=torch.uint8) for _ in range(2 if trainers == 1 else 1)]
            for _ in range(trainers)
        ]
        self.slots = [torch.zeros(2 * bucket, dtype=torch.uint8) for _ in range(rollouts)]
        for t, s in zip(self.t[trainers:], self.slots, strict=False):
            t.expose(SLOTS, s, access="w")
        self.rules = policies or [None] * trainers
        self.next_update()

    def next_update(self) -> None:
        """Plan the next update and begin it on every engine (as init_process_group does: one
        still running is superseded); new senders and receivers over the same memory."""
        self.plan()
        self.begin(range(len(self.t)))

    def plan(self) -> None:
        """Plan the next update (no engine begins it yet: :meth:`begin`)."""
        trainers, bucket = self.trainers, self.bucket
        infos = []
        for i, t in enumerate(self.t):
            held = "" if self.copies is None else self.copies[i].token
            info = EngineInfo(t.name, "mem://" if i == 0 else None, bucket, self.degree)
            infos.append(replace(info, delta=self.copies is not None, holds=held))
        self.tp, self.rp = build_plans(trainers, len(self.t) - trainers, infos)
        self.senders: list = [None] * trainers
        self.receivers: list = [None] * len(self.rp)
        self.send_errors: list[BaseException | None] = [None] * trainers

    def begin(self, engines) -> None:
        """Begin the planned update on ``engines`` (indices, trainer ranks first), in order."""
        trainers, bucket = self.trainers, self.bucket
        mine = self.copies or [None] * len(self.t)
        plans = self.tp + self.rp
        for e in engines:
            self.inbox[e].begin(plans[e].token, 30.0, writes=plans[e].targets)
            if e < trainers:
                self.senders[e] = BucketSender(
                    self.t[e],
                    self.inbox[e],
                    plans[e],
                    self.buffers[e],
                    10.0,
                    mine[e],
                    self.rules[e],
                )
                continue
            i = e - trainers
            self.receivers[i] = BucketReceiver(
                self.t[e],
                self.inbox[e],
                plans[e],
                self.slots[i],
                Assembler("cpu"),
                10.0,
                mine[e],
                torch.empty(bucket, dtype=torch.uint8),
            )

    def send_all(self, weights: dict[str, torch.Tensor]) -> list[threading.Thread]:
        self.send_errors: list[BaseException | None] = [None] * len(self.senders)

        return [self.send(i, iter(weights.items())) for i in range(len(self.senders))]

    def send(self, rank: int, items: Iterator[tuple[str, torch.Tensor]]) -> threading.Thread:
        """Rank ``rank`` sends ``items`` in a thread (its error, if any, in ``send_errors``)."""
        sender, errors = self.senders[rank], self.send_errors

        def run() -> None:
            try:
                asyncio.run(sender.send(items))
            except BaseException as e:  # noqa: BLE001 - the test reads it
                errors[rank] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th


def collect(
    receiver: BucketReceiver,
    hold: threading.Event | None = None,
    at: int = -1,
    held: list | None = None,
) -> dict[str, torch.Tensor]:
    """Everything ``receiver`` yields (cloned); at the ``at``-th tensor, keep a view and wait
    for ``hold``."""

    async def run() -> dict[str, torch.Tensor]:
        out = {}
        i = 0
        async for name, t in receiver.receive():
            if i == at and hold is not None and held is not None:
                held.append((name, t, t.clone()))
                await asyncio.to_thread(hold.wait, 60)
            out[name] = t.clone()
            i += 1
        return out

    return asyncio.run(run())


def record_waits(monkeypatch) -> list[str]:
    """What every Inbox.wait from now on waits for (its ``what``), in order."""
    waits: list[str] = []
    real_wait = Inbox.wait

    def wait(self, ready, **kw):
        waits.append(kw["what"])
        return real_wait(self, ready, **kw)

    monkeypatch.setattr(Inbox, "wait", wait)
    return waits


def receive_all(job: Job) -> Iterator[dict[str, torch.Tensor]]:
    results: list = [None] * len(job.receivers)

    def run(i: int) -> None:
        try:
            results[i] = collect(job.receivers[i])
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(job.receivers))
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    yield from results


@pytest.mark.parametrize(
    ("trainers", "rollouts", "degree"), [(1, 1, 0), (2, 3, 0), (2, 5, 2), (3, 4, 1)]
)
def test_every_receiver_gets_every_tensor_in_order(
    loopback_net, trainers, rollouts, degree
) -> None:
    weights = model(200, seed=trainers * 10 + rollouts)
    job = Job(loopback_net, trainers, rollouts, 64 * KIB, degree)
    senders = job.send_all(weights)
    for got in receive_all(job):
        assert not isinstance(got, BaseException), got
        assert list(got) == list(weights)
        for name, t in weights.items():
            assert torch.equal(got[name], t), name
    for th in senders:
        th.join(30)
    assert job.send_errors == [None] * trainers
    buckets = [s.report.buckets for s in job.senders]
    assert sum(buckets) == job.receivers[0].buckets > 4  # the ranks shared the buckets
    assert max(buckets) - min(buckets) <= 1


def test_delta_buckets_carry_only_the_changes_and_every_tensor_lands_bit_for_bit(
    loopback_net,
) -> None:
    """Engines with copies, kept across updates: the first update goes raw, a step that flips
    bits of 2% of the elements goes as changes (a small part of the bytes), through a relay
    too, and a tensor changed whole sends its buckets raw; every receiver yields every tensor,
    bit for bit. A receiver whose copies hold another update refuses changes, naming it."""
    copies = [PieceCopies() for _ in range(2 + 3)]
    w1 = model(200, seed=5)
    w2 = {n: t.clone() for n, t in w1.items()}
    g = torch.Generator().manual_seed(9)
    for t in w2.values():
        raw = t.reshape(-1).view(torch.uint8)
        if raw.numel():
            flip = torch.rand(raw.numel(), generator=g) < 0.02
            raw[flip] ^= 1
    w3 = {n: t.clone() for n, t in w2.items()}
    w3["lm_head.weight"] += 1  # every element of the tensor larger than a bucket
    sent, as_changes = [], []
    for k, weights in enumerate([w1, w2, w3]):
        held = copies[0].token  # "" before the first update
        job = Job(loopback_net, 2, 3, 64 * KIB, degree=1, copies=copies, prefix=f"u{k}-")
        assert job.tp[0].base == held and bool(held) == (k > 0)
        senders = job.send_all(weights)
        for got in receive_all(job):
            assert not isinstance(got, BaseException), got
            assert list(got) == list(weights)
            for name, t in weights.items():
                assert torch.equal(
                    got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                ), name
        for th in senders:
            th.join(30)
        assert job.send_errors == [None, None]
        sent.append(sum(s.report.bytes_sent for s in job.senders))
        as_changes.append(sum(s.report.as_changes for s in job.senders))
        buckets = job.receivers[0].buckets
        assert {c.token for c in copies} == {job.tp[0].token}
    assert as_changes[0] == 0 and as_changes[1] == buckets, as_changes  # all of them
    assert 0 < as_changes[2] < buckets, as_changes  # lm_head's buckets raw
    # 2% of the bytes flipped (of 8-byte elements, 15% changed), and every header raw
    assert sent[1] < 0.35 * sent[0], sent
    # copies of another update: changes are refused before a byte is applied
    copies[3].token = "0" * 16
    held = copies[0].token
    job = Job(loopback_net, 1, 1, 64 * KIB, copies=[copies[0], copies[3]], prefix="u9-")
    assert job.tp[0].base == ""  # the plan sees that they differ: every bucket raw
    copies[0].token, copies[3].token = held, "0" * 16  # as they were before the Job began
    bad = replace(job.rp[0], base=held)
    receiver = BucketReceiver(
        job.t[1], job.inbox[1], bad, job.slots[0], Assembler("cpu"), 10.0, copies[3]
    )
    job.senders[0] = BucketSender(
        job.t[0],
        job.inbox[0],
        replace(job.tp[0], base=copies[0].token),
        job.buffers[0],
        10.0,
        copies[0],
    )
    job.receivers[0] = receiver
    job.send_all(w2)
    (got,) = receive_all(job)
    assert isinstance(got, WireFormatError) and "came as changes" in str(got), got


def test_auto_rests_without_copies_then_looks_and_diffs_again(loopback_net) -> None:
    """``delta="auto"`` at both trainer ranks: while their policies diff, the ranks send changes
    once every engine holds the same update; policies that found changes lost rest: their ranks
    let go of their copies and send raw (so the job's next update goes raw everywhere), the
    update of the look takes copies again, and the one after goes as changes. Every tensor
    lands bit for bit."""
    copies = [PieceCopies() for _ in range(2 + 2)]
    policies = [DeltaPolicy(auto=True) for _ in range(2)]
    weights = model(200, seed=7)
    g = torch.Generator().manual_seed(3)
    as_changes, diffing = [], []
    for k in range(5):
        for t in weights.values():  # a step: 2% of the bytes flipped
            raw = t.reshape(-1).view(torch.uint8)
            if k and raw.numel():
                raw[torch.rand(raw.numel(), generator=g) < 0.02] ^= 1
        if k == 2:
            for p in policies:  # as a policy leaves itself when changes lost (policy.py)
                p.resting, p.wait, p.diff_s, p.patch_s = 2, 8, None, None
        job = Job(loopback_net, 2, 2, 64 * KIB, copies=copies, prefix=f"a{k}-", policies=policies)
        senders = job.send_all(weights)
        for got in receive_all(job):
            assert not isinstance(got, BaseException), got
            for name, t in weights.items():
                assert torch.equal(
                    got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
                ), (k, name)
        for th in senders:
            th.join(30)
        assert job.send_errors == [None, None]
        as_changes.append(sum(s.report.as_changes for s in job.senders))
        diffing.append([s.report.diffing for s in job.senders])
        if k == 2:  # resting: no copies held
            assert [c.copies for c in copies[:2]] == [{}, {}]
    buckets = job.receivers[0].buckets
    assert as_changes == [0, buckets, 0, 0, buckets], as_changes
    assert diffing == [[True, True], [True, True], [False, False], [True, True], [True, True]]


def test_a_slow_receiver_holds_the_sender_two_buckets_ahead_and_its_slot_is_never_written(
    loopback_net, monkeypatch
) -> None:
    weights = {f"w{i}": pattern(15 * KIB, i) for i in range(40)}  # 4 tensors per 64 KiB bucket
    job = Job(loopback_net, 1, 1, 64 * KIB)
    waits = record_waits(monkeypatch)
    hold, held, out = threading.Event(), [], {}
    th = threading.Thread(
        target=lambda: out.update(collect(job.receivers[0], hold, at=13, held=held))
    )
    th.start()  # tensor 13 lies in bucket 3 (slot 1)
    senders = job.send_all(weights)
    # the receiver frees bucket 2's slot once it yielded tensor 11: the sender may wait for
    # bucket 5's slot before the receiver reached tensor 13; both must have happened
    wait_until(
        lambda: held and any("free slot for bucket 5" in w for w in waits),
        30,
        "the receiver holding tensor 13 and the sender waiting for slot 1",
    )
    assert job.senders[0].report.buckets == 5  # buckets 0..4: the held bucket 3's slot is next
    name, view, copy = held[0]
    assert name == "w13" and torch.equal(view, copy) and torch.equal(view, weights["w13"])
    hold.set()
    th.join(30)
    for s in senders:
        s.join(30)
    assert job.send_errors == [None] and list(out) == list(weights)
    assert all(torch.equal(out[n], t) for n, t in weights.items())


@pytest.mark.parametrize("when", ["at once", "while the ranks wait for its slot"])
def test_a_receiver_that_leaves_is_dropped_with_its_reason_and_the_others_complete(
    loopback_net, monkeypatch, when
) -> None:
    weights = model(100)
    job = Job(loopback_net, 2, 3, 32 * KIB)
    gone = job.t[3]  # rollout worker 1
    waits = record_waits(monkeypatch)
    senders = job.send_all(weights)
    if when != "at once":
        # no receiver runs yet: each rank waits for the slot of its first bucket at every worker
        for index in (0, 1):
            wait_until(
                lambda index=index: any(f"free slot for bucket {index} at" in w for w in waits),
                30,
                f"a rank waiting for the slots of bucket {index}",
            )
    gone.close()
    results = list(receive_all(job))
    for i in (0, 2):
        assert not isinstance(results[i], BaseException), results[i]
        assert all(torch.equal(results[i][n], t) for n, t in weights.items())
    for th in senders:
        th.join(30)
    assert job.send_errors == [None, None]
    for s in job.senders:
        assert list(s.report.dropped) == [gone.name], s.report.dropped
        if when != "at once":  # seen to have closed, not waited for until the deadline
            assert "it closed" in s.report.dropped[gone.name], s.report.dropped


def test_a_trainer_rank_that_is_gone_fails_the_update_everywhere_naming_it(loopback_net) -> None:
    weights = model(100)
    job = Job(loopback_net, 2, 2, 32 * KIB)
    gone = job.t[1].name
    job.t[1].close()  # trainer rank 1 leaves: bucket 1 never comes
    senders = job.send_all(weights)
    results = list(receive_all(job))
    for got in results:
        assert isinstance(got, UpdateAbortedError), got
        assert f"trainer rank 1 ({gone}) is gone" in str(
            got
        ) and "received 1 buckets of the update" in str(got)
    for th in senders[:1]:
        th.join(30)
    assert isinstance(job.send_errors[0], UpdateAbortedError), job.send_errors[0]
    assert f"trainer rank 1 ({gone}) is gone" in str(job.send_errors[0])


def test_a_relay_that_leaves_costs_only_its_subtree_and_they_name_it(loopback_net) -> None:
    weights = model(100)
    job = Job(loopback_net, 1, 4, 32 * KIB, degree=1)  # a chain: trainer -> r0 -> r1 -> r2 -> r3
    relay = job.t[2]  # rollout worker 1, the parent of worker 2
    job.receivers[1] = None  # it never takes part: gone before the update
    relay.close()
    senders = job.send_all(weights)
    results: list = [None] * 4

    def run(i: int) -> None:
        try:
            results[i] = collect(job.receivers[i])
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 2, 3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert all(torch.equal(results[0][n], t) for n, t in weights.items())  # the root completes
    assert isinstance(
        results[2], UpdateAbortedError
    ) and f"relay {relay.name}, this worker's parent, is gone" in str(results[2])
    assert isinstance(results[3], UpdateAbortedError) and "stopped relaying" in str(results[3])
    for th in senders:
        th.join(30)
    assert job.send_errors == [None]


def test_an_update_superseded_mid_flight_stops_everywhere_and_the_next_lands_whole(
    loopback_net, monkeypatch
) -> None:
    """verl's manager starts the next update at the first error it sees, while other engines
    still run the failed one. Here the trainer waits for a slot, the relay's consumer holds a
    tensor, and its child waits for a bucket, when every engine begins the next update: each
    old one stops (UpdateSupersededError, naming both updates) at its next step, even the relay once
    its consumer resumes in the middle of the next update, and the next update's bytes land
    exactly at both workers."""
    old_weights, new_weights = model(100, seed=1), model(100, seed=2)
    job = Job(loopback_net, 1, 2, 32 * KIB, degree=1)  # trainer -> r1 -> r2
    waits = record_waits(monkeypatch)
    old_token = job.tp[0].token
    hold, held, old_results = threading.Event(), [], [None, None]

    def receive(i: int, results: list, **kw) -> None:
        try:
            results[i] = collect(job.receivers[i], **kw)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    old = [
        threading.Thread(
            target=receive, args=(0, old_results), kwargs=dict(hold=hold, at=5, held=held)
        ),
        threading.Thread(target=receive, args=(1, old_results)),
    ]
    for th in old:
        th.start()
    old_sender = job.send_all(old_weights)[0]
    old_errors = job.send_errors
    wait_until(
        lambda: held and any("free slot for bucket" in w for w in waits),
        30,
        "the relay holding a tensor and the trainer waiting for a slot",
    )
    job.next_update()
    new_token = job.tp[0].token
    old_sender.join(30)
    assert isinstance(old_errors[0], UpdateSupersededError), old_errors[0]
    assert f"update {old_token}" in str(old_errors[0]) and f"by update {new_token}" in str(
        old_errors[0]
    )
    new_results: list = [None, None]
    new = [threading.Thread(target=receive, args=(i, new_results)) for i in (0, 1)]
    for th in new:
        th.start()
    senders = job.send_all(new_weights)
    hold.set()  # the old relay resumes while the next update runs
    for th in [*old, *new, *senders]:
        th.join(60)
    for got in old_results:
        assert isinstance(got, UpdateSupersededError), got
    assert job.send_errors == [None]
    for got in new_results:
        assert not isinstance(got, BaseException), got
        assert list(got) == list(new_weights)
        assert all(torch.equal(got[n], t) for n, t in new_weights.items())


def test_begin_waits_for_the_puts_the_superseded_update_has_in_flight(loopback_net) -> None:
    """The next update begins only once every put of the one it supersedes settled: a put still
    pending fails ``begin`` at its timeout, naming the update and the peer (and is waited for
    again by the next ``begin``); the old update can post nothing more."""
    inbox = Inbox(loopback_net.make("writer"))
    first, second, third = "1" * 16, "2" * 16, "3" * 16
    inbox.begin(first)
    pending = Handle("put", ("reader",), 4096, 1)
    assert inbox.post(first, lambda: pending) is pending
    with pytest.raises(TransportError, match=rf"1 bucket puts of update {first} to \['reader'\]"):
        inbox.begin(second, settle_timeout=0.05)
    started: list[str] = []
    with pytest.raises(
        UpdateSupersededError, match=f"update {first} on {inbox.transport.name} was superseded"
    ):
        inbox.post(first, lambda: started.append("posted"))  # type: ignore[arg-type, return-value]
    assert not started
    with pytest.raises(TransportError, match="still in flight"):
        inbox.begin(third, settle_timeout=0.05)  # the same put, waited for again
    pending.part_done("reader", None)
    inbox.begin(third, settle_timeout=5.0)
    inbox.check(third)


def gated(
    items: dict[str, torch.Tensor], at: str, gate: threading.Event
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` in order, waiting for ``gate`` before tensor ``at`` (a trainer's stream that
    stalls)."""
    for name, t in items.items():
        if name == at:
            assert gate.wait(60), "the gate never opened"
        yield name, t


def first_in_bucket(items: dict[str, torch.Tensor], bucket: int, index: int) -> str:
    """The name of the first tensor whose bytes go into bucket ``index``."""
    packer = Packer(bucket)
    for name, t in items.items():
        before = packer.index
        for item in packer.add(name, t):
            if not isinstance(item, Planned) and packer.index == index:
                return name
        if before == index:
            return name
    raise AssertionError(f"no bucket {index}")


@pytest.mark.parametrize("order", ["trainers first", "receivers first"])
def test_engines_that_begin_an_update_in_any_order_and_send_at_once_land_it_whole(
    loopback_net, order
) -> None:
    """An orchestrator that starts each engine's part as soon as its init_process_group
    returned, without waiting for the others: the trainer ranks send before a relay and its
    child began the update, or the child begins before its relay. No bucket is dropped as a
    message of another update, and every byte lands."""
    first, second = model(100, seed=3), model(100, seed=4)
    job = Job(loopback_net, 2, 3, 32 * KIB, degree=1)  # ranks -> r2 -> r3 -> r4
    job.send_all(first)
    for got in receive_all(job):
        assert not isinstance(got, BaseException), got
    job.plan()
    engines = [0, 1, 2, 3, 4] if order == "trainers first" else [4, 3, 2, 1, 0]
    results: list = [None] * 3
    threads = []

    def receive(i: int) -> None:
        try:
            results[i] = collect(job.receivers[i])
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    for e in engines:
        job.begin([e])
        if e < 2:
            threads.append(job.send(e, iter(second.items())))
        else:
            threads.append(threading.Thread(target=receive, args=(e - 2,), daemon=True))
            threads[-1].start()
    for th in threads:
        th.join(60)
    assert job.send_errors == [None, None]
    for got in results:
        assert not isinstance(got, BaseException), got
        assert list(got) == list(second)
        assert all(torch.equal(got[n], t) for n, t in second.items())


def test_a_rank_still_in_the_old_update_cannot_land_a_put_in_the_next(loopback_net) -> None:
    """Three trainer ranks write one worker's two slots in turn. Rank 2 holds the worker's credit
    for bucket 2 (slot 0) of the old update, its stream stalled, when the orchestrator begins the
    next update on every engine but rank 2. Rank 2's stream then goes on and puts the old
    bucket 2 into slot 0; only then is rank 2 told of the next update. The worker freed its
    slots for the next update only once rank 2 began it too, so the next update's bucket 0 is
    not overwritten: every byte of it is the next update's."""
    bucket = 32 * KIB
    old = {f"w{i}": pattern(3 * KIB, 100 + i) for i in range(60)}
    new = {f"w{i}": pattern(3 * KIB, 200 + i) for i in range(60)}
    job = Job(loopback_net, 3, 1, bucket)
    worker = job.t[3].name
    gate = threading.Event()
    at = first_in_bucket(old, bucket, 2)
    old_threads = [job.send(0, iter(old.items())), job.send(1, iter(old.items()))]
    stale = job.send(2, gated(old, at, gate))
    old_result: list = [None]
    # the worker's consumer holds the first tensor of bucket 1: it freed slot 0 for bucket 2, and
    # it does not see the next update begin (so it tells no rank to stop) until it resumes
    hold, held = threading.Event(), []
    at_bucket_1 = list(old).index(first_in_bucket(old, bucket, 1))

    def receive_old() -> None:
        try:
            old_result[0] = collect(job.receivers[0], hold, at=at_bucket_1, held=held)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            old_result[0] = e

    old_receiver = threading.Thread(target=receive_old, daemon=True)
    old_receiver.start()
    wait_until(
        lambda: job.inbox[2].may_write(worker, 2), 30, "rank 2 holding the slot for bucket 2"
    )
    # and the consumer holding bucket 1 (rank 2 holds its slot from the moment the worker freed
    # it, after bucket 0, before bucket 1 came): a worker still waiting for bucket 1 when the next
    # update begins gives the old one up at once and stops rank 2, whose put never comes
    wait_until(lambda: held, 30, "the worker's consumer holding the first tensor of bucket 1")
    stale_sender = job.senders[2]
    job.plan()
    job.begin([0, 1, 3])  # every engine but rank 2
    results: list = [None]

    def receive_new() -> None:
        try:
            results[0] = collect(job.receivers[0])
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[0] = e

    new_threads = [job.send(0, iter(new.items())), job.send(1, iter(new.items()))]
    new_receiver = threading.Thread(target=receive_new, daemon=True)
    new_receiver.start()
    gate.set()  # rank 2 goes on with the old update and puts bucket 2 into slot 0
    wait_until(lambda: stale_sender.report.buckets == 1, 30, "rank 2's put of the old bucket 2")
    job.begin([2])  # now rank 2 hears of the next update (its old put settles first)
    new_threads.append(job.send(2, iter(new.items())))
    new_receiver.join(60)
    hold.set()
    for th in [*old_threads, stale, old_receiver, *new_threads]:
        th.join(60)
    assert isinstance(old_result[0], UpdateSupersededError), old_result[0]
    assert job.send_errors == [None, None, None]
    got = results[0]
    assert not isinstance(got, BaseException), got
    assert list(got) == list(new)
    wrong = [n for n, t in new.items() if not torch.equal(got[n], t)]
    assert not wrong, f"tensors of the old update in the new one: {wrong}"


def test_messages_of_an_update_not_begun_yet_are_kept_up_to_a_bound(loopback_net) -> None:
    """A peer's ``Begun`` that comes before this engine began its update is filed when the
    update begins; beyond MAX_EARLY such messages the oldest go, so a peer cannot grow an
    engine's memory with messages of updates that never begin."""
    from transport.weights.buckets import inbox as inbox_module
    from transport.weights.buckets.messages import CHANNEL

    writer, reader = loopback_net.make("writer"), loopback_net.make("reader")
    inbox = Inbox(reader)
    tokens = [f"{i:016x}" for i in range(inbox_module.MAX_EARLY + 10)]
    arrived = threading.Event()
    reader.core.on_control("probe", lambda peer, payload: arrived.set())
    for token in tokens:
        writer.core.send_control(reader.name, CHANNEL, encode(Begun(token)))
    writer.core.send_control(reader.name, "probe", b"after them")  # in order on one connection
    assert arrived.wait(30)
    inbox.begin(tokens[-1])
    assert writer.name in inbox.begun
    inbox.begin(tokens[0])  # the first was dropped for a later one
    assert writer.name not in inbox.begun
    inbox.begin(tokens[20])  # early messages are filed by the next begin only, then forgotten
    assert writer.name not in inbox.begun


def test_a_worker_that_joins_the_store_after_its_trainer_began_still_gets_every_byte(
    loopback_net,
) -> None:
    """Engines without a store of their own join it in their init_process_group, so a trainer
    rank may begin an update before its worker is in the store: its ``Begun`` finds nobody. It
    is said again while the rank waits for the worker's first free slot, and the update lands."""
    weights, bucket = model(60, seed=5), 32 * KIB
    trainer = loopback_net.make("t0", heartbeat_interval=0.2)
    late = loopback_net.name("r1")
    infos = [EngineInfo(trainer.name, "mem://", bucket, 0), EngineInfo(late, None, bucket, 0)]
    (tp,), (rp,) = build_plans(1, 1, infos)
    inbox = Inbox(trainer)
    inbox.begin(tp.token, 30.0, writes=tp.targets)  # the worker is not in the store yet
    buffers = [torch.empty(bucket, dtype=torch.uint8) for _ in range(2)]
    sender = BucketSender(trainer, inbox, tp, buffers, 30.0)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            asyncio.run(sender.send(iter(weights.items())))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    worker = loopback_net.make("r1", heartbeat_interval=0.2)
    slots = torch.zeros(2 * bucket, dtype=torch.uint8)
    worker.expose(SLOTS, slots, access="w")
    worker_inbox = Inbox(worker)
    worker_inbox.begin(rp.token, 30.0, writes=rp.targets)
    got = collect(BucketReceiver(worker, worker_inbox, rp, slots, Assembler("cpu"), 30.0))
    th.join(30)
    assert errors == [] and sender.report.dropped == {}
    assert list(got) == list(weights)
    assert all(torch.equal(got[n], t) for n, t in weights.items())
