"""Withdrawing a region (unexpose): announced, writers stop and confirm, the memory is let go, and
no writer writes into it afterwards; a writer that cannot confirm is named."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import transport
from helpers.peer import Peer, sha
from helpers.polling import wait_until

MiB = 1 << 20


def test_no_writer_writes_into_withdrawn_memory(tcp_store):
    with transport.Transport("owner", store=tcp_store, timeout=30) as owner:
        buf = torch.zeros(MiB, dtype=torch.uint8)
        keep = torch.zeros(4096, dtype=torch.uint8)
        owner.expose("buf", buf, access="w")
        owner.expose("keep", keep, access="w")
        writers = [Peer(f"writer-{i}", tcp_store.url) for i in range(2)]
        try:
            for i, w in enumerate(writers):
                w.call("wait_for_peer", "owner", 30)
                w.call("put_loop_start", "owner", "buf", MiB, i + 1)
            for w in writers:
                wait_until(lambda w=w: w.call("put_loop_count") >= 20, 30, "puts into buf")
            silent = owner.unexpose("buf", timeout=10)
            assert silent == []  # both confirmed: nothing of theirs is in flight into buf
            # from now on the bytes of buf are the owner's: mark them, and keep the writers trying
            buf.fill_(0xAB)
            marked = sha(buf)
            outcomes = [w.call("put_loop_stop", 30) for w in writers]
            for out in outcomes:  # each loop ended on a clear error, not a write
                assert out["error"] is not None and "RegionError" in out["error"], out
                assert "buf" in out["error"]
            for w in writers:
                with pytest.raises(Exception, match="RegionError"):
                    w.call("put_pattern", "owner", "buf", MiB, 9, 10)
            assert sha(buf) == marked  # nobody wrote after the withdrawal
            assert "buf" not in owner.regions() and "keep" in owner.regions()
            # the other region is untouched by all this
            h = writers[0].call("put_pattern", "owner", "keep", 4096, 5, 10)
            assert sha(keep) == h
        finally:
            for w in writers:
                w.stop()


def test_a_frozen_writer_is_named_and_the_others_confirm(tcp_store):
    with transport.Transport("owner", store=tcp_store, timeout=30) as owner:
        buf = torch.zeros(4096, dtype=torch.uint8)
        owner.expose("buf", buf, access="w")
        ok, frozen = Peer("writer-ok", tcp_store.url), Peer("writer-frozen", tcp_store.url)
        try:
            for w in (ok, frozen):
                w.call("put_pattern", "owner", "buf", 4096, 1, 30)
            frozen.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert owner.unexpose("buf", timeout=1.0) == ["writer-frozen"]
                assert time.monotonic() - t0 < 10
            finally:
                frozen.signal(signal.SIGCONT)
            with pytest.raises(Exception, match="RegionError"):
                ok.call("put_pattern", "owner", "buf", 4096, 2, 10)
        finally:
            ok.stop()
            frozen.stop()


def test_unexpose_bad_input(tcp_store):
    with transport.Transport("owner", store=tcp_store) as owner:
        owner.expose("x", torch.zeros(16))
        with pytest.raises(KeyError, match="'nope' is not exposed"):
            owner.unexpose("nope")
        with pytest.raises(TypeError):
            owner.unexpose(3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout"):
            owner.unexpose("x", timeout=0)
        assert "x" in owner.regions()
        assert owner.unexpose("x", timeout=5) == []  # nobody else in the namespace
        owner.expose("x", torch.ones(16))  # the name is free again
        assert "x" in owner.regions()


def test_a_writer_that_leaves_without_answering_is_not_waited_for(tcp_store):
    """A writer asked to stop that closes instead of answering leaves its mark in the store; the
    withdrawal stops waiting for it there, and does not name it as one that may still write."""
    import threading

    from helpers import internals

    with transport.Transport("owner", store=tcp_store, timeout=30) as owner:
        owner.expose("buf", torch.zeros(4096, dtype=torch.uint8), access="w")
        writer = transport.Transport("quiet-writer", store=tcp_store, timeout=30)
        writer.put(torch.ones(4096, dtype=torch.uint8), "owner", "buf").wait(30)
        asked = internals.mute_withdrawals(writer)
        silent: list[list[str]] = []
        withdrawal = threading.Thread(target=lambda: silent.append(owner.unexpose("buf", 120)))
        withdrawal.start()
        assert asked.wait(30), "the writer was not asked"
        writer.close()
        withdrawal.join(60)
        assert not withdrawal.is_alive(), "the withdrawal still waits for a writer that left"
        assert silent == [[]]
