"""Host transfers with a peer of the same machine go by cross-memory attach (backends/cma.py):
the bytes land whole in both directions, at every size; a peer is taken only once it has
proven itself, and only while its memory is open; a peer that closed its Transport, exited,
froze or unmapped its memory gets what NIXL's own path gives it, or less, and never a byte more.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import transport
from helpers import internals
from helpers.child import START_TIMEOUT, ChildProcess, serve
from helpers.peer import Cycler, Peer, pattern, sha
from transport.backends import cma
from transport.backends.cma import CmaPeers, CmaTransfer, Identity

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
needs_cma = pytest.mark.skipif(
    cma.refusal() is not None, reason=f"this process takes no CMA transfers: {cma.refusal()}"
)


def agent_of(t: transport.Transport, peer: str) -> str:
    conn = internals.connection(t, peer)
    assert conn is not None, f"no connection to {peer}"
    return conn.agent


@needs_cma
def test_puts_and_gets_with_a_peer_of_this_machine_go_by_cma_and_land_whole(tcp_store):
    sizes = [1, 4096, 3 * MiB + 5, 24 * MiB]  # the fast path, one part, and a lanes' split
    regions = {f"r{i}": ("uint8", n, "rw") for i, n in enumerate(sizes)}
    with (
        Peer("gen", tcp_store.url, regions) as p,
        transport.Transport("writer", store=tcp_store, lanes=2, lane_bytes=16 * MiB) as w,
    ):
        w.wait_for_peer("gen", 30)
        for i, n in enumerate(sizes):
            src = pattern(n, i)
            w.put(src, "gen", f"r{i}").wait(60)
            assert p.call("sha", f"r{i}") == sha(src)
            back = torch.empty(n, dtype=torch.uint8)
            p.call("fill", f"r{i}", 100 + i)
            w.get(back, "gen", f"r{i}").wait(60)
            assert sha(back) == p.call("sha", f"r{i}") != sha(src)
        assert internals.backend(w).cma.reachable(agent_of(w, "gen"))
        small = [pl for pl in internals.plans(w) if pl.nbytes == 4096]
        assert small and all(pl.direct is not None for pl in small)  # ran inside the call
        # a batch of scattered tensors into every region at once, with a notification
        batch = {f"r{i}": pattern(n, 50 + i) for i, n in enumerate(sizes)}
        w.put(batch, "gen", notify=b"all").wait(60)
        _, payload, shas = p.call("notif_then_sha", 30, list(batch))
        assert payload == b"all" and shas == {k: sha(v) for k, v in batch.items()}


@needs_cma
def test_a_peer_that_closed_its_transport_takes_no_more_bytes(tcp_store):
    c = Cycler("gen", tcp_store.url, 64 * 1024)
    try:
        c.call("open")
        with transport.Transport("writer", store=tcp_store) as w:
            w.wait_for_peer("gen", 30)
            first = pattern(64 * 1024, 1)
            w.put(first, "gen", "buf").wait(30)
            small = pattern(4096, 2)
            w.put(small, "gen", "buf").wait(30)  # the fast path's plan, made while it was open
            assert internals.backend(w).cma.reachable(agent_of(w, "gen"))
            c.call("close")  # the process and the tensor live on
            for src in (small, pattern(64 * 1024, 3)):
                try:  # refused by the put (the peer has left) or by its handle (the gate)
                    err = w.put(src, "gen", "buf", timeout=10).exception(30)
                except transport.PeerNotFoundError as e:
                    err = e
                assert isinstance(err, (transport.PeerLostError, transport.PeerNotFoundError)), err
            expected = torch.cat([small, first[4096:]])
            assert c.call("sha") == sha(expected)  # nothing landed after the close
    finally:
        c.stop()


@needs_cma
def test_a_killed_peer_fails_the_put_as_lost(tcp_store):
    p = Peer("victim", tcp_store.url, {"buf": ("uint8", 4096, "w")})
    try:
        with transport.Transport("writer", store=tcp_store) as w:
            w.wait_for_peer("victim", 30)
            w.put(pattern(4096, 1), "victim", "buf").wait(30)
            p.kill()
            err = w.put(pattern(4096, 2), "victim", "buf", timeout=10).exception(30)
            assert isinstance(err, transport.PeerLostError), err
    finally:
        p.kill()


@needs_cma
def test_a_frozen_peer_takes_a_plain_put_and_a_notified_one_fails_at_its_deadline(tcp_store):
    with (
        Peer("frozen", tcp_store.url, {"buf": ("uint8", MiB, "w")}) as p,
        transport.Transport("writer", store=tcp_store) as w,
    ):
        w.wait_for_peer("frozen", 30)
        w.put(pattern(MiB, 1), "frozen", "buf", notify=b"a").wait(30)
        assert p.call("notification", 30) == ("writer", b"a")
        p.signal(signal.SIGSTOP)
        try:
            plain = pattern(MiB, 2)
            w.put(plain, "frozen", "buf").wait(30)  # one-sided: no call of the peer is needed
            err = w.put(pattern(MiB, 3), "frozen", "buf", notify=b"b", timeout=1.0).exception(30)
            assert isinstance(err, transport.TransferTimeout), err
        finally:
            p.signal(signal.SIGCONT)
        last = pattern(MiB, 4)
        w.put(last, "frozen", "buf", notify=b"c").wait(30)
        # the timed-out put's notification may come or not (it was given up); "c" comes last
        notes = [p.call("notification", 30)]
        if notes[0] != ("writer", b"c"):
            notes.append(p.call("notification", 30))
        assert notes[-1] == ("writer", b"c") and set(notes) <= {("writer", b"b"), ("writer", b"c")}
        assert p.call("sha", "buf") == sha(last)


def _unmapping_child(conn: Any, name: str, store: str) -> None:
    """A peer that exposes an mmap'd buffer and, on ``unmap``, unmaps it behind the library's
    back (never touching it again); ``ping`` proves it lives."""
    mm = mmap.mmap(-1, MiB)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    t = transport.Transport(name, store=store)
    t.expose("buf", buf, access="w")
    conn.send(("ok", (t.generation, os.getpid())))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    serve(
        conn,
        {"unmap": lambda: libc.munmap(addr, MiB), "ping": lambda: "alive"},
        lambda: os._exit(0),  # its memory is gone: no orderly close
    )


@needs_cma
def test_memory_the_peer_unmapped_fails_the_put_and_the_peer_lives(tcp_store):
    child = ChildProcess("gen", _unmapping_child, (tcp_store.url,), START_TIMEOUT)
    try:
        with transport.Transport("writer", store=tcp_store) as w:
            w.wait_for_peer("gen", 30)
            w.put(pattern(MiB, 1), "gen", "buf").wait(30)
            w.put(pattern(4096, 1), "gen", "buf").wait(30)
            assert child.call("unmap") == 0
            for n in (4096, MiB):
                err = w.put(pattern(n, 2), "gen", "buf", timeout=10).exception(30)
                assert isinstance(err, transport.RegionError), err
                assert "not mapped" in str(err)
            assert child.call("ping") == "alive"
    finally:
        child.kill()


def test_cma_off_moves_the_same_bytes_through_nixl(tcp_store, monkeypatch):
    monkeypatch.setenv(cma.CMA_ENV, "0")
    with (
        Peer("gen", tcp_store.url, {"buf": ("uint8", 2 * MiB, "rw")}) as p,
        transport.Transport("writer", store=tcp_store) as w,
    ):
        w.wait_for_peer("gen", 30)
        for n, seed in ((4096, 1), (2 * MiB, 2)):
            src = pattern(n, seed)
            w.put(src, "gen", "buf").wait(30)
            assert p.call("sha_range", "buf", 0, n) == sha(src)
        assert not internals.backend(w).cma.reachable(agent_of(w, "gen"))
        assert all(pl.direct is None for pl in internals.plans(w))


# -- the proof of a peer and the gate, in one process -------------------------------------------


@needs_cma
def test_only_an_identity_that_proves_itself_is_taken():
    owner, writer = CmaPeers(), CmaPeers()
    try:
        real = owner.identity
        forged = [
            Identity(real.pid, real.gate_fd, real.netns, real.token_at, bytes(16)),  # token
            Identity(real.pid, real.gate_fd, real.netns + 1, real.token_at, real.token),  # netns
            Identity(real.pid, real.gate_fd, real.netns, real.token_at + 64, real.token),  # addr
            Identity(real.pid, 0, real.netns, real.token_at, real.token),  # another fd
            Identity(os.getppid(), real.gate_fd, real.netns, real.token_at, real.token),  # pid
        ]
        for i, ident in enumerate(forged):
            assert not writer.add(f"forged-{i}", ident), ident
            assert not writer.reachable(f"forged-{i}")
        assert writer.add("owner", real) and writer.reachable("owner")
        assert Identity.split(owner.header() + b"rest") == (real, b"rest")
    finally:
        owner.close()
        writer.close()


@needs_cma
def test_the_gate_refuses_every_run_once_shut_and_rows_past_the_kernels_limit_land():
    owner, writer = CmaPeers(), CmaPeers()
    try:
        assert writer.add("owner", owner.identity)
        dst = torch.zeros(3000 * 8, dtype=torch.uint8)
        src = pattern(3000 * 8, 9)
        # 3,000 rows, reversed (no two adjacent): three system calls of at most 1,024 rows
        order = np.arange(3000)[::-1]
        local = np.array([(src.data_ptr() + 8 * i, 8, 0) for i in order], dtype=np.uint64)
        remote = np.array([(dst.data_ptr() + 8 * i, 8, 0) for i in order], dtype=np.uint64)
        xfer = writer.transfer("WRITE", "owner", local, remote, "owner")
        assert isinstance(xfer, CmaTransfer) and xfer.nbytes == 3000 * 8
        xfer.run()
        assert torch.equal(dst, src)
        bad = writer.transfer("WRITE", "owner", local[:1], np.array([[8, 8, 0]], np.uint64), "o")
        assert bad is not None
        with pytest.raises(transport.RegionError, match="not mapped"):
            bad.run()
        with pytest.raises(ValueError, match="pair up"):
            writer.transfer("WRITE", "owner", local[:2], remote[:1], "owner")
        assert owner.shut(5.0)
        dst.zero_()
        with pytest.raises(transport.PeerLostError, match="closed"):
            xfer.run()
        assert int(dst.sum()) == 0
    finally:
        owner.close()
        writer.close()


@needs_cma
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_rows_adjacent_on_either_side_merge_and_every_byte_lands_where_its_row_says(op):
    """Small tensors of separate allocations into one flat region (and back): the rows adjacent
    on one side merge there, each call moves the same bytes on both sides, and every byte lands
    where its row pairs it, past the kernel's limit of 1,024 iovecs a call too."""
    owner, writer = CmaPeers(), CmaPeers()
    try:
        assert writer.add("owner", owner.identity)
        n, width = 3000, 24
        flat = torch.zeros(n * width, dtype=torch.uint8)  # adjacent rows, one after another
        # the other side: rows 48 bytes apart (24 bytes of nobody's between them), every fifth
        # run of rows adjacent there too, in a shuffled order of the runs
        loose = torch.zeros(n * 2 * width, dtype=torch.uint8)
        step = [width if i % 5 else 2 * width for i in range(n)]
        at = np.cumsum([0, *step[:-1]])
        perm = np.random.default_rng(7).permutation(n)
        flat_rows = np.array([(flat.data_ptr() + width * i, width, 0) for i in perm], np.uint64)
        loose_rows = np.array([(loose.data_ptr() + int(at[i]), width, 0) for i in perm], np.uint64)
        src, dst = (loose, flat) if op == "WRITE" else (flat, loose)
        src.copy_(pattern(src.numel(), 11))
        local, remote = (loose_rows, flat_rows) if op == "WRITE" else (flat_rows, loose_rows)
        xfer = writer.transfer(op, "owner", local, remote, "owner")
        assert isinstance(xfer, CmaTransfer) and xfer.nbytes == n * width
        xfer.run()
        for i in range(n):  # each row's bytes where its pair is
            f, lo = flat[width * i : width * (i + 1)], loose[int(at[i]) : int(at[i]) + width]
            assert torch.equal(f, lo), f"row {i}"
        # shuffled: few rows adjacent in the order given; sorted, the flat side is one run and
        # the loose side one in five: the calls follow the side with more iovecs
        order = np.argsort(flat_rows[:, 0])
        merged = writer.transfer(op, "owner", local[order], remote[order], "owner")
        assert merged is not None and merged.calls == -(-(n // 5) // 1024)
        dst.zero_()
        merged.run()
        assert torch.equal(
            flat.view(n, width),
            loose.view(-1)[torch.from_numpy(at).unsqueeze(1) + torch.arange(width)],
        )
    finally:
        owner.close()
        writer.close()


#: where csrc/cma.c keeps the writers' counts in a gate: after the token (16 bytes), ``open`` and
#: the shared count (8 each), 250 slots of (writer key, runs in progress), 8 bytes each
SLOTS_AT, SLOT = 32, struct.Struct("<qq")


@needs_cma
def test_a_writer_that_died_inside_a_run_does_not_hold_the_owners_close():
    """A writer counts its runs in its own slot of the owner's gate, keyed by its pid; one killed
    inside a run leaves its count behind, and the owner's close does not wait for it (a shared
    count made every close after such a death wait its whole timeout). A live writer with a run
    counted is waited for. The counts are written into the gate as those writers leave them."""
    owner, writer = CmaPeers(), CmaPeers()
    try:
        assert writer.add("owner", owner.identity)
        dst, src = torch.zeros(4096, dtype=torch.uint8), pattern(4096, 3)
        rows = [[src.data_ptr(), 4096, 0]], [[dst.data_ptr(), 4096, 0]]
        xfer = writer.transfer("WRITE", "owner", *(np.array(r, np.uint64) for r in rows), "o")
        assert xfer is not None
        xfer.run()
        assert torch.equal(dst, src)
        page = mmap.mmap(owner.identity.gate_fd, mmap.PAGESIZE)
        key, active = SLOT.unpack_from(page, SLOTS_AT)
        assert key >> 32 == os.getpid() and active == 0  # the writer's slot, nothing in progress
    finally:
        owner.close()
        writer.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        for pid, free in ((dead.pid, True), (alive.pid, False)):
            owner = CmaPeers()
            try:
                page = mmap.mmap(owner.identity.gate_fd, mmap.PAGESIZE)
                SLOT.pack_into(page, SLOTS_AT + SLOT.size, (pid << 32) | 7, 1)  # one run counted
                # the dead writer's run is not waited for: shut at once (the whole 30 s before);
                # the live one's is, until the timeout
                assert owner.shut(30.0 if free else 0.5) is free, pid
            finally:
                owner.close()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tls", "taken"),
    [("", True), ("all", True), ("tcp,cma", True), ("sm,tcp", True), ("tcp", False)]
    + [("rc,ud", False), ("^cma", False), ("^tcp", True)],
)
def test_cma_is_taken_only_where_ucx_would_copy_through_the_kernel(tls, taken):
    why = cma.refusal(tls)
    if cma.native() is None:
        assert why is not None and "not built" in why
    else:
        assert (why is None) == taken, why


@pytest.mark.unit
def test_a_malformed_identity_header_is_refused_with_the_rule():
    good = Identity(4321, 7, 1, 0x1000, bytes(16)).encode()
    with pytest.raises(transport.WireFormatError, match="same version"):
        Identity.split(good[:10])
    with pytest.raises(transport.WireFormatError, match="version"):
        Identity.split(good[:4] + b"\x09" + good[5:])
    assert Identity.split(b"plain nixl metadata") == (None, b"plain nixl metadata")
