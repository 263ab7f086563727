"""The flight recorder: what a ring holds, dumps on error by every live Transport of the namespace
(a request through the store), on SIGUSR1 and on demand, and ``transport trace`` naming the
transfers that never completed and the peer that went silent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import transport
from helpers.peer import Peer, pattern, sha
from helpers.processes import REPO
from transport.store import MemoryStore

MiB = 1 << 20


def wait_for_files(d: Path, pred, timeout: float) -> list[Path]:
    """The dumps in ``d`` once ``pred(list)`` holds (polling the directory until the deadline)."""
    end = time.monotonic() + timeout
    while True:
        files = sorted(d.glob("*.jsonl"))
        if pred(files):
            return files
        if time.monotonic() > end:
            raise AssertionError(f"dumps in {d} after {timeout} s: {[f.name for f in files]}")
        time.sleep(0.05)  # sync-ok: the poll interval of a deadline-bounded wait for files


def read(path: Path) -> tuple[dict, list[dict]]:
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(x) for x in lines[1:]]


def test_the_ring_records_every_kind_and_keeps_the_newest(tcp_store, tmp_path):
    with (
        Peer("b", tcp_store.url, {"x": ("float32", 1024, "w")}) as b,
        transport.Transport("a", store=tcp_store, trace_capacity=8) as a,
    ):
        a.wait_for_peer("b", 30)
        handles = []
        for i in range(40):  # batches take the general path: a post and an end each
            handles.append(a.put({"x": torch.full((1024,), float(i))}, "b"))
            handles[-1].wait(10)
        head, events = read(a.dump_trace(tmp_path, "test"))
        assert head["name"] == "a" and head["reason"] == "test" and head["capacity"] == 8
        assert len(events) == 8 and events[-1]["kind"] == "dump"
        ids = [h.id for h in handles]
        assert [(e["kind"], e["handle"]) for e in events[:-1]] == [
            ("done", ids[-4]),
            *[(k, i) for i in ids[-3:] for k in ("post", "done")],
        ]
        for e in events[:-1]:
            assert e["bytes"] == 4096 and e["peers"] == ["b"] and e["op"] == "put"
            assert e["keys"] == (["x"] if e["kind"] == "post" else None)
        assert b.call("sha", "x") == sha(torch.full((1024,), 39.0))
        # registered memory, small: a put that completes inside its post is counted, not recorded
        src = torch.ones(1024)
        a.register(src)
        fast = []
        for _ in range(10):
            fast.append(a.put(src, "b", "x"))
            fast[-1].wait(10)
        head, events = read(a.dump_trace(tmp_path, "fast"))
        recorded = {e["handle"] for e in events} & {h.id for h in fast}
        assert head["inline_completed"] + len(recorded) == 10
        assert head["inline_completed"] >= 5  # CMA: after the first ones, every one
        # memory not registered before: posted, then done; the bytes are there
        h = a.put(torch.full((1024,), 2.0), "b", "x", notify=b"n")
        h.wait(10)
        _, events = read(a.dump_trace(tmp_path, "two"))
        mine = [(e["kind"], e["keys"]) for e in events if e["handle"] == h.id]
        assert mine == [("post", ["x"]), ("done", None)]
        assert b.call("sha", "x") == sha(torch.full((1024,), 2.0))
    store = MemoryStore()
    with (
        transport.Transport("c", store=store) as c,
        transport.Transport("d", store=store) as d,
    ):
        d.expose("y", torch.zeros(256))
        c.put({"y": torch.ones(256)}, "d", notify=b"hi").wait(10)
        assert d.wait_notification(10).payload == b"hi"
        _, dev = read(d.dump_trace(tmp_path, "d"))
        assert [(e["kind"], e["peers"], e["bytes"]) for e in dev if e["kind"] == "notif"] == [
            ("notif", ["c"], 2)
        ]
        with pytest.raises(transport.PeerNotFoundError):
            c.put(torch.ones(4), "nobody", "y")
        d.close()
        err = c.put(torch.ones(256), "d", "y", timeout=5).exception(10)
        assert err is not None
        _, cev = read(c.dump_trace(tmp_path, "c"))
        assert [e["kind"] for e in cev if e["kind"] in ("join", "error", "lost", "timeout")][
            :1
        ] == ["join"]
        assert any(e["kind"] in ("error", "timeout") for e in cev), cev
    off = transport.Transport("z", store=MemoryStore(), trace_capacity=0)
    try:
        _, events = read(off.dump_trace(tmp_path, "off"))
        assert events == []  # nothing recorded, not even the dump
    finally:
        off.close()
    with pytest.raises(ValueError, match="trace_capacity"):
        transport.Transport("bad", store=MemoryStore(), trace_capacity=-1)
    with pytest.raises(ValueError, match="no directory"):
        with transport.Transport("nodir", store=MemoryStore()) as t:
            t.dump_trace()


def test_an_error_makes_every_live_peer_dump_and_trace_names_the_silent_one(tcp_store, tmp_path):
    d = tmp_path / "trace"
    frozen = Peer("frozen", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")}, trace_dir=str(d))
    other = Peer("other", tcp_store.url, {"buf": ("uint8", 4 * MiB, "w")}, trace_dir=str(d))
    try:
        with transport.Transport("writer", store=tcp_store, trace_dir=d, timeout=30) as w:
            for p in ("frozen", "other"):
                w.wait_for_peer(p, 30)
            src = pattern(4 * MiB, 1)
            w.put(src, "frozen", "buf", notify=b"a").wait(30)
            w.put(src, "other", "buf").wait(30)
            frozen.signal(signal.SIGSTOP)
            try:
                stuck = w.put(src, "frozen", "buf", notify=b"b", timeout=60)  # still pending
                short = w.put(src, "frozen", "buf", notify=b"c", timeout=0.5)
                assert isinstance(short.exception(10), transport.TransferTimeout)
                # the writer dumps and asks the namespace: "other" dumps too; "frozen" cannot
                files = wait_for_files(
                    d, lambda fs: {f.name.split(".")[1] for f in fs} >= {"writer", "other"}, 15
                )
                assert not any(".frozen." in f.name for f in files)
                out = subprocess.run(
                    [sys.executable, "-m", "transport.cli", "trace", str(d)],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                js = subprocess.run(
                    [sys.executable, "-m", "transport.cli", "trace", str(d), "--json"],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert not stuck.done()
            finally:
                frozen.signal(signal.SIGCONT)
            stuck.wait(30)
    finally:
        frozen.stop()
        other.stop()
    assert out.returncode == 0, out.stderr
    a = json.loads(js.stdout)
    unfinished = [e for e in a["unfinished"] if e["at"].startswith("writer#")]
    assert [e["handle"] for e in unfinished] == [stuck.id], unfinished
    assert unfinished[0]["peers"] == ["frozen"] and unfinished[0]["bytes"] == 4 * MiB
    assert [s["peer"] for s in a["silent"]] == ["frozen"]
    assert "no dump from it" in a["silent"][0]["why"]
    assert any(e["kind"] == "timeout" and e["handle"] == short.id for e in a["timeline"])
    reasons = {h["name"]: h["reason"] for h in a["dumps"]}
    assert reasons["writer"].startswith("a transfer ended with a timeout")
    assert "asked" in reasons["other"]
    assert f"#{stuck.id} put of 4.0 MiB from writer#" in out.stdout
    assert "frozen: " in out.stdout and "no dump from it" in out.stdout


def test_sigusr1_dumps_the_ring(tcp_store, tmp_path):
    with Peer("p", tcp_store.url, {"buf": ("uint8", 1024, "w")}, trace_dir=str(tmp_path)) as p:
        p.call("sha", "buf")  # started
        p.signal(signal.SIGUSR1)
        (f,) = wait_for_files(tmp_path, lambda fs: len(fs) == 1, 15)
        head, events = read(f)
        assert head["name"] == "p" and head["reason"] == "SIGUSR1" and head["pid"] == p.pid
        assert events[-1]["kind"] == "dump"
        assert p.call("sha", "buf")  # alive and serving after the signal


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "is not a directory"),
        (lambda d: d, "no flight-recorder dumps"),
    ],
)
def test_trace_command_errors_are_one_line(tmp_path, make, message):
    out = subprocess.run(
        [sys.executable, "-m", "transport.cli", "trace", str(make(tmp_path))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and message in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
