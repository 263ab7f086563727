"""``transport bench``: the smoke runs CI makes (every system, every size, every record verified;
the speed is not asserted), the cross-host mode on one machine, and bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.processes import REPO, LineReader, free_port
from transport.cli import main
from transport.cli.bench._systems import Memcpy
from transport.cli.bench._util import parse_batch, parse_size, parse_sizes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transport.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000, len(data)  # axes, lines and labels, not an empty canvas


@pytest.fixture(scope="module")
def put_quick(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    d = tmp_path_factory.mktemp("put")
    out = cli(
        "bench", "put", "--quick", "--json", str(d / "put.json"), "--plot", str(d / "put.png")
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads((d / "put.json").read_text()), d / "put.png"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_put_quick_measures_every_system_at_every_size_and_verifies_each(put_quick):
    out, doc, _ = put_quick
    records = doc["records"]
    sizes = doc["config"]["sizes"]
    assert sizes == [4096, 1 << 20, 64 << 20]
    assert all(r["verified"] for r in records)
    for op in ("write", "read"):
        for n in sizes:
            systems = {
                r["system"]
                for r in records
                if r["op"] == op and r["bytes"] == n and r["kind"] == "single"
            }
            assert {"ours", "raw-nixl", "raw-nixl-repost"} <= systems, (op, n, systems)
    for n in sizes:
        systems = {
            r["system"]
            for r in records
            if r["op"] == "write" and r["bytes"] == n and r["kind"] == "single"
        }
        assert {"gloo", "gloo-bcast", "memcpy"} <= systems, (n, systems)
    batch = {r["system"] for r in records if r["kind"] == "batch" and r["op"] == "write"}
    assert {"ours", "ours-single", "raw-nixl", "gloo", "memcpy"} <= batch
    # every family of the default --baselines is there, nccl skipped with a reason where no CUDA
    assert {r["family"] for r in records} >= {"ours", "raw", "gloo", "memcpy"}
    assert "nccl" in doc["skipped"] or any(r["family"] == "nccl" for r in records)
    # the ratios the issue asks for, and the environment
    targets = {(x["op"], x["size"], x["metric"]) for x in doc["ratios"] if x["target"] is not None}
    assert ("write", "4 KiB", "latency") in targets and ("write", "64 MiB", "bandwidth") in targets
    env = doc["environment"]
    assert env["versions"]["torch"] and env["versions"]["nixl"] and env["versions"]["transport"]
    assert env["ucx"]["UCX_TLS"] and env["cpu"]["count"] >= 1 and "gpu" in env
    # the table on stdout; no progress bar when stderr is not a terminal
    assert "targets: ours against raw-nixl" in out.stdout and "WRITE, 1 receiver" in out.stdout
    assert "\r" not in out.stderr


@pytest.mark.slow
def test_put_plot_is_a_png(put_quick):
    assert_png(put_quick[2])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_quick_measures_every_system_and_verifies_each(tmp_path):
    out = cli(
        "bench",
        "sync",
        "--quick",
        "--json",
        str(tmp_path / "s.json"),
        "--plot",
        str(tmp_path / "s.png"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    systems = {r["system"]: r for r in doc["records"]}
    assert {"ours", "raw-nixl", "gloo-bcast", "memcpy"} <= set(systems)
    assert all(r["verified"] for r in doc["records"])
    assert systems["ours"]["tensors"] == 50 and systems["ours"]["generators"] == 2
    assert systems["ours"]["bytes"] == 16 * 2**20 * 4  # 16M float32 parameters
    assert {x["vs"] for x in doc["ratios"]} >= {"raw-nixl", "gloo-bcast"}
    assert "ours/raw time" in out.stdout
    assert_png(tmp_path / "s.png")


@pytest.mark.delta
def test_sync_with_delta_sends_changes_and_verifies_them(tmp_path):
    """--delta: each sync changes 2% of the elements; ours-delta sends each version as its
    changes (a small part of it), ours-auto whichever way it judges faster, and each is verified
    on a version that went as changes onto one that went whole."""
    out = cli(
        "bench",
        "sync",
        "--quick",
        "--params",
        "4M",
        "--tensors",
        "8",
        "--dtypes",
        "bfloat16,float32",
        "--delta",
        "0.02",
        "--baselines",
        "none",
        "--json",
        str(tmp_path / "d.json"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "d.json").read_text())
    systems = {r["system"]: r for r in doc["records"]}
    assert {"ours", "ours-delta", "ours-auto"} <= set(systems)
    assert all(r["verified"] for r in doc["records"])
    whole = systems["ours"]["bytes"] * 2  # to 2 generators
    assert systems["ours-delta"]["trainer_bytes"] < 0.2 * whole
    assert systems["ours-auto"]["trainer_bytes"] <= whole
    assert "changed 2.00% of the elements" in out.stdout


def test_sync_of_a_sharded_trainer_verifies_every_system(tmp_path):
    """2 rank processes into TP=2 fused fp8 generators, against gloo gather and no conversion."""
    out = cli(
        "bench",
        "sync",
        "--quick",
        "--trainer-ranks",
        "2",
        "--dest-layout",
        "tp2-fused",
        "--dest-dtype",
        "fp8",
        "--json",
        str(tmp_path / "s.json"),
        "--plot",
        str(tmp_path / "s.png"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["verified"] == {"ours": True, "gloo-gather": True, "ours-noconv": True}
    assert doc["config"]["ranks"] == 2 and doc["config"]["dest_dtype"] == "fp8"
    assert set(doc["ratios"]) == {"gloo-gather/ours", "ours/ours-noconv"}
    # what each system holds beyond the shards: our staging pool; the whole model on rank 0
    assert doc["held_bytes"]["ours"] == 32 << 20
    assert doc["held_bytes"]["gloo-gather"] >= doc["config"]["bytes"] // 4  # fp8 matrices
    assert "gloo-gather/ours" in out.stdout
    assert_png(tmp_path / "s.png")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_put_compares_lane_settings(tmp_path):
    out = cli(
        "bench",
        "put",
        "--quick",
        "--sizes",
        "4K,96M",
        "--op",
        "write",
        "--batch",
        "none",
        "--baselines",
        "raw",
        "--lanes",
        "2,1",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "p.json").read_text())
    got = {(r["system"], r["size"]) for r in doc["records"]}
    for size in ("4 KiB", "96 MiB"):
        assert {("ours", size), ("ours-lanes1", size), ("raw-nixl", size)} <= got
    assert all(r["verified"] for r in doc["records"])  # every setting's bytes checked


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_compares_direct_and_relayed_fan_out(tmp_path):
    out = cli(
        "bench",
        "sync",
        "--quick",
        "--generators",
        "3",
        "--fanout",
        "direct,chain,tree",
        "--baselines",
        "raw",
        "--json",
        str(tmp_path / "s.json"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    systems = {r["system"]: r for r in doc["records"]}
    assert set(systems) == {"raw-nixl", "ours", "ours-chain", "ours-tree"}
    assert all(r["verified"] for r in doc["records"])  # every generator checked every tensor
    size = systems["ours"]["bytes"]
    assert [systems[s]["trainer_bytes"] for s in ("ours", "ours-chain", "ours-tree")] == [
        3 * size,
        size,
        size,
    ]
    assert {x["name"] for x in doc["ratios"]} >= {"ours-chain/ours time", "ours-tree/ours time"}
    assert "ours-tree/ours time" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_writer_and_reader_started_by_hand_meet_in_a_store(tmp_path):
    """Cross-host mode on one machine: a reader (hosting the embedded store) and a writer, two
    processes that only share the store URL."""
    url = f"tcp://127.0.0.1:{free_port()}"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transport.cli",
            "bench",
            "put",
            "--store",
            url,
            "--role",
            "reader",
            "--name",
            "gen-a",
            "--wait",
            "120",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    lines = LineReader(reader.stdout)
    try:
        first = lines.next_line(timeout=60)  # it hosts the store now
        assert first is not None and "joined namespace 'bench'" in first, first
        out = cli(
            "bench",
            "put",
            "--store",
            url,
            "--role",
            "writer",
            "--peers",
            "gen-a",
            "--quick",
            "--sizes",
            "4K,1M",
            "--batch",
            "none",
            "--baselines",
            "raw,gloo",
            "--json",
            str(tmp_path / "x.json"),
            "--wait",
            "120",
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert reader.wait(timeout=60) == 0, reader.stderr.read() if reader.stderr else ""
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    doc = json.loads((tmp_path / "x.json").read_text())
    assert all(r["verified"] for r in doc["records"])
    got = {(r["system"], r["op"], r["size"]) for r in doc["records"]}
    for size in ("4 KiB", "1 MiB"):
        for op in ("write", "read"):
            assert {("ours", op, size), ("raw-nixl", op, size)} <= got
        assert ("gloo", "write", size) in got


BAD = [
    (
        ["bench", "put", "--sizes", "4K,4Q"],
        "size '4Q' is not understood; use a whole number with an optional suffix K, M or G",
    ),
    (["bench", "put", "--receivers", "0"], "--receivers must be at least 1, got 0"),
    (
        ["bench", "put", "--baselines", "raw,foo"],
        "unknown baseline 'foo'; known baselines: raw, gloo, memcpy, nccl",
    ),
    (["bench", "put", "--batch", "10y4K"], "is not COUNTxSIZE"),
    (["bench", "put", "--role", "writer", "--peers", "a"], "--role writer needs --store URL"),
    (
        ["bench", "put", "--store", "tcp://127.0.0.1:1", "--role", "reader"],
        "--role reader needs --name",
    ),
    (["bench", "sync", "--dtypes", "float33"], "unknown dtype 'float33'"),
    (["bench", "sync", "--generators", "0"], "--generators must be at least 1"),
    (["bench", "sync", "--fanout", "direct,ring"], "unknown --fanout 'ring'"),
    (["bench", "put", "--lanes", "2,0"], "--lanes takes counts from 1 to 16, got '0'"),
    (["bench", "sync", "--mode", "inplace", "--fanout", "chain"], "needs --mode staging"),
    (["bench", "sync", "--fanout", "tree", "--degree", "0"], "--degree must be from 1 to 16"),
    (["bench", "sync", "--experts", "-1"], "--experts must be at least 0"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_arguments_are_one_line_and_non_zero(args, message, capsys):
    """The command's ``main`` in this process (a process of its own costs a second of imports
    each; the unreachable store below checks a real process's status and streams)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out = capsys.readouterr()
    assert code not in (0, None)
    assert out.err.count("\n") == 1, out.err
    assert message in out.err, out.err
    assert out.out == ""


def test_unreachable_store_is_one_line_and_non_zero():
    port = free_port()
    out = cli(
        "bench",
        "put",
        "--store",
        f"tcp://127.0.0.1:{port}",
        "--role",
        "writer",
        "--peers",
        "gen-a",
        timeout=60,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from transport.cli import main\n"
        f"sys.exit(main(['bench', 'put', '--quick', '--plot', {str(tmp_path / 'p.png')!r}]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "pip install transport[bench]" in out.stderr, out.stderr
    assert not (tmp_path / "p.png").exists()


def test_sizes_parse_in_every_accepted_form():
    assert [
        parse_size(s)
        for s in ("4096", "4K", "4k", "4KB", "4KiB", "64KiB", "1M", "1MiB", "1G", "1.5K")
    ] == [
        4096,
        4096,
        4096,
        4096,
        4096,
        65536,
        1 << 20,
        1 << 20,
        1 << 30,
        1536,
    ]
    assert parse_sizes("1M,4K,4K") == [4096, 1 << 20]
    assert parse_batch("1000x64K") == (1000, 65536)
    for bad in ("4Q", "K", "-4K", "0", "4 KiBs", "0.3"):
        with pytest.raises(ValueError, match="whole number"):
            parse_size(bad)
    for bad in ("1000", "0x4K", "x4K", "10x"):
        with pytest.raises(ValueError):
            parse_batch(bad)


@pytest.mark.parametrize(
    ("cpus", "pin", "lanes", "readers", "pinned", "noted"),
    [
        (2, None, 2, 1, False, True),  # lanes pinned onto one CPU could not copy in parallel
        (4, None, 2, 1, True, False),
        (3, None, 2, 1, True, False),
        (2, True, 2, 1, True, False),  # asked for: pinned, CPUs shared
        (16, False, 2, 1, False, False),
    ],
)
def test_pinning_is_left_off_where_the_lanes_would_share_a_cpu(
    monkeypatch, cpus, pin, lanes, readers, pinned, noted
):
    from transport.cli.bench import _util

    monkeypatch.setattr(_util, "affinity", lambda: set(range(cpus)))
    got, note = _util.pin_layout(pin, lanes, readers)
    assert got is pinned and (note is not None) is noted
    if note:
        assert f"need {lanes + readers} CPUs" in note and "--pin" in note


# -- the System contract and the runner, in-process (no readers) ----------------------------------


class Lossy(Memcpy):
    """A memcpy that loses the last byte: verify must catch it."""

    def step(self) -> None:
        super().step()
        self.dst[-1].view(-1).view(torch.uint8)[-1:].zero_()


def _tensors() -> list[Any]:
    # a whole pattern block and a tail, and another dtype: every byte must be checked
    return [torch.ones(70_000, dtype=torch.uint8), torch.ones(33, dtype=torch.float32)]


def test_memcpy_system_keeps_the_contract_and_verifies_every_byte():
    m = Memcpy(_tensors(), repeat=2)
    m.setup()
    assert len(m.run(3)) == 3
    assert m.verify(seed=5)
    assert all(torch.equal(d, s) for d, s in zip(m.dst, m.src, strict=True))
    assert not Lossy(_tensors()).verify(seed=5)
    m.close()


def test_runner_records_interleaved_systems_with_paired_ratios_and_refuses_lost_bytes():
    from transport import CliError
    from transport.cli.bench._runner import Results, Timing, Turn, measure
    from transport.cli.bench.put import PutCase

    case = PutCase("write", 1, "single", "4 KiB", 4096)
    a, b = Memcpy(_tensors()), Memcpy(_tensors())
    b.name = "memcpy-b"
    res, seeds = Results(), iter(range(1, 100, 7))
    turn = Turn(
        "two copies",
        case,
        [a, b],
        Timing(0.0, 3, 3, 1, 2),
        ["memcpy", "memcpy-b"],
        [("memcpy", "memcpy-b")],
    )
    measure(turn, res, seeds)
    first, second = (r.json() for r in res.records)
    assert first["verified"] and second["verified"]
    assert first["iters"] == 6 and first["cycles"] == 3 and first["block"] == 2
    assert set(first["paired_time_ratio"]) == {"memcpy-b"} and "paired_time_ratio" not in second
    assert list(first)[:8] == [
        "system",
        "family",
        "op",
        "receivers",
        "kind",
        "size",
        "bytes",
        "total_bytes",
    ]
    lossy = Turn("lossy", case, [Lossy(_tensors())], Timing(0.0, 2, 2))
    with pytest.raises(CliError, match="did not land"):
        measure(lossy, Results(), seeds)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_with_flat_layouts_verifies_thousands_of_tensors(tmp_path):
    out = cli(
        "bench",
        "sync",
        "--quick",
        "--tensors",
        "3000",
        "--layout",
        "flat",
        "--baselines",
        "raw",
        "--json",
        str(tmp_path / "s.json"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "s.json").read_text())
    systems = {r["system"]: r for r in doc["records"]}
    assert systems["ours"]["tensors"] == 3000 and {"ours", "raw-nixl"} <= set(systems)
    assert all(r["verified"] for r in doc["records"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_of_a_mixture_of_experts_in_hugging_face_layout_verifies_every_expert(tmp_path):
    """One tensor per expert matrix, separately allocated: the trainer packs the small ones."""
    args = ["--quick", "--experts", "16", "--layers", "4", "--dtypes", "bfloat16"]
    out = cli("bench", "sync", *args, "--baselines", "raw", "--json", str(tmp_path / "m.json"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "a mixture of 16 experts x 4 layers" in out.stdout
    doc = json.loads((tmp_path / "m.json").read_text())
    systems = {r["system"]: r for r in doc["records"]}
    assert systems["ours"]["tensors"] == 4 * (9 + 16 * 3) + 3
    assert all(r["verified"] for r in doc["records"]) and {"ours", "raw-nixl"} <= set(systems)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_put_with_a_secret_and_notifications_verifies_its_bytes(tmp_path):
    out = cli(
        "bench",
        "put",
        "--quick",
        "--sizes",
        "4K,1M",
        "--op",
        "write",
        "--batch",
        "none",
        "--baselines",
        "raw",
        "--secret",
        "--notify",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((tmp_path / "p.json").read_text())
    assert {r["system"] for r in doc["records"]} >= {"ours", "raw-nixl"}
    assert all(r["verified"] for r in doc["records"])


def test_the_ucx_probe_is_kept_for_the_next_run_with_the_same_settings(tmp_path, monkeypatch):
    """The first run probes what UCX picks here (a child process); the next run with the same
    settings reads what it found, and a run with another UCX setting probes again."""
    from transport.cli.bench import _report

    monkeypatch.setenv("TRANSPORT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("UCX_RNDV_THRESH", raising=False)
    first = _report.ucx_probe()()
    assert first["probe"] == "ok" and first["version"][0].isdigit(), first
    assert any(k.startswith("remote memory write") for k in first["protocols"]), first
    assert len(list(tmp_path.glob("ucx-probe-*.json"))) == 1
    again = _report.ucx_probe()()
    assert again == {**first, "probe": "cached"}
    monkeypatch.setenv("UCX_RNDV_THRESH", "inf")  # another setting: what UCX picks may differ
    other = _report.ucx_probe()()
    assert other["probe"] == "ok" and other["UCX_RNDV_THRESH"] == "inf", other
    assert len(list(tmp_path.glob("ucx-probe-*.json"))) == 2
